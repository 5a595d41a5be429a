"""Compile shaders/*.comp into the committed vkrt/spirv/ with a pinned glslang."""
