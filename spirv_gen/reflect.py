"""Just enough SPIR-V reflection for the manifest: bindings, writes, push constants, spec ids."""

from __future__ import annotations

import struct
from typing import Any

# Opcodes and enums from the SPIR-V specification.
OP_EXECUTION_MODE, OP_TYPE_INT, OP_TYPE_FLOAT, OP_TYPE_VECTOR = 16, 21, 22, 23
OP_TYPE_IMAGE, OP_TYPE_SAMPLED_IMAGE, OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY = 25, 27, 28, 29
OP_TYPE_STRUCT, OP_TYPE_POINTER, OP_CONSTANT, OP_SPEC_CONSTANT = 30, 32, 43, 50
OP_SPEC_CONSTANT_TRUE, OP_SPEC_CONSTANT_FALSE, OP_VARIABLE = 48, 49, 59
OP_DECORATE, OP_MEMBER_DECORATE = 71, 72
DEC_SPEC_ID, DEC_BLOCK, DEC_BUFFER_BLOCK, DEC_ARRAY_STRIDE = 1, 2, 3, 6
DEC_NON_WRITABLE, DEC_BINDING, DEC_SET, DEC_OFFSET = 24, 33, 34, 35
SC_UNIFORM_CONSTANT, SC_UNIFORM, SC_PUSH_CONSTANT, SC_STORAGE_BUFFER = 0, 2, 9, 12
DIM_BUFFER, EXEC_MODE_LOCAL_SIZE, IMAGE_SAMPLED = 5, 17, 1


def reflect(spirv: bytes) -> dict[str, Any]:
    words = struct.unpack(f"<{len(spirv) // 4}I", spirv)
    if words[0] != 0x07230203:
        raise ValueError("not a SPIR-V module")
    types: dict[int, tuple] = {}
    pointers: dict[int, tuple[int, int]] = {}
    constants: dict[int, int] = {}
    decorations: dict[int, dict[int, list[int]]] = {}
    member_decorations: dict[int, dict[int, dict[int, list[int]]]] = {}
    variables: list[tuple[int, int, int]] = []
    spec_defaults: dict[int, int] = {}
    local_size: list[int] | None = None
    i = 5
    while i < len(words):
        count, opcode = words[i] >> 16, words[i] & 0xFFFF
        ops = words[i + 1 : i + count]
        if opcode in (OP_TYPE_INT, OP_TYPE_FLOAT):
            types[ops[0]] = ("scalar", ops[1] // 8)
        elif opcode == OP_TYPE_VECTOR:
            types[ops[0]] = ("vector", ops[1], ops[2])
        elif opcode == OP_TYPE_IMAGE:
            types[ops[0]] = ("image", ops[2], ops[6])  # dim, sampled (1 sampled, 2 storage)
        elif opcode == OP_TYPE_SAMPLED_IMAGE:
            types[ops[0]] = ("sampled_image", ops[1])
        elif opcode == OP_TYPE_ARRAY:
            types[ops[0]] = ("array", ops[1], ops[2])
        elif opcode == OP_TYPE_RUNTIME_ARRAY:
            types[ops[0]] = ("runtime_array", ops[1])
        elif opcode == OP_TYPE_STRUCT:
            types[ops[0]] = ("struct", tuple(ops[1:]))
        elif opcode == OP_TYPE_POINTER:
            pointers[ops[0]] = (ops[1], ops[2])
        elif opcode == OP_CONSTANT:
            constants[ops[1]] = ops[2]
        elif opcode in (OP_SPEC_CONSTANT, OP_SPEC_CONSTANT_TRUE, OP_SPEC_CONSTANT_FALSE):
            value = ops[2] if opcode == OP_SPEC_CONSTANT else int(opcode == OP_SPEC_CONSTANT_TRUE)
            spec_defaults[ops[1]] = value
        elif opcode == OP_VARIABLE:
            variables.append((ops[0], ops[1], ops[2]))
        elif opcode == OP_DECORATE:
            decorations.setdefault(ops[0], {})[ops[1]] = list(ops[2:])
        elif opcode == OP_MEMBER_DECORATE:
            member_decorations.setdefault(ops[0], {}).setdefault(ops[1], {})[ops[2]] = list(ops[3:])
        elif opcode == OP_EXECUTION_MODE and ops[1] == EXEC_MODE_LOCAL_SIZE:
            local_size = list(ops[2:5])
        i += count

    def size_of(type_id: int) -> int:
        kind = types[type_id]
        if kind[0] == "scalar":
            return kind[1]
        if kind[0] == "vector":
            return size_of(kind[1]) * kind[2]
        if kind[0] == "array":
            stride = decorations.get(type_id, {}).get(DEC_ARRAY_STRIDE, [size_of(kind[1])])[0]
            return stride * constants[kind[2]]
        if kind[0] == "struct":
            offsets = member_decorations.get(type_id, {})
            return max(offsets[m][DEC_OFFSET][0] + size_of(t) for m, t in enumerate(kind[1]))
        raise ValueError(f"cannot size SPIR-V type {kind}")

    bindings = []
    push_constant_size = 0
    for pointer_type, var_id, storage_class in variables:
        pointee = pointers[pointer_type][1]
        if storage_class == SC_PUSH_CONSTANT:
            push_constant_size = size_of(pointee)
            continue
        dec = decorations.get(var_id, {})
        if DEC_BINDING not in dec:
            continue
        kind = types.get(pointee, ("?",))
        struct_dec = decorations.get(pointee, {})
        if storage_class == SC_STORAGE_BUFFER or (storage_class == SC_UNIFORM and DEC_BUFFER_BLOCK in struct_dec):
            members = member_decorations.get(pointee, {})
            readonly = DEC_NON_WRITABLE in dec or (
                kind[0] == "struct" and all(DEC_NON_WRITABLE in members.get(m, {}) for m in range(len(kind[1])))
            )
            descriptor, written = "storage_buffer", not readonly
        elif storage_class == SC_UNIFORM:
            descriptor, written = "uniform_buffer", False
        elif storage_class == SC_UNIFORM_CONSTANT and kind[0] == "sampled_image":
            image = types[kind[1]]
            if image[1] != DIM_BUFFER:
                raise ValueError("only buffer textures are supported")
            descriptor, written = "uniform_texel_buffer", False
        elif storage_class == SC_UNIFORM_CONSTANT and kind[0] == "image" and kind[1] == DIM_BUFFER:
            # Sampled 1: a textureBuffer (uniform texel buffer); 2: an imageBuffer (storage).
            if kind[2] == IMAGE_SAMPLED:
                descriptor, written = "uniform_texel_buffer", False
            else:
                descriptor, written = "storage_texel_buffer", DEC_NON_WRITABLE not in dec
        else:
            raise ValueError(f"unsupported descriptor (storage class {storage_class}, type {kind})")
        bindings.append({"set": dec.get(DEC_SET, [0])[0], "binding": dec[DEC_BINDING][0],
                         "type": descriptor, "written": written})
    bindings.sort(key=lambda b: (b["set"], b["binding"]))
    spec_ids = {decorations[cid][DEC_SPEC_ID][0]: spec_defaults[cid]
                for cid in spec_defaults if DEC_SPEC_ID in decorations.get(cid, {})}
    return {
        "bindings": bindings,
        "push_constant_size": push_constant_size,
        "spec_constants": {str(k): v for k, v in sorted(spec_ids.items())},
        "local_size": local_size,
    }
