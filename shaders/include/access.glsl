// Memory-access paths, chosen per device at pipeline build (the ACCESS_* define).
//   ACCESS_TEXEL: read-only operands are read-only storage texel buffers (imageLoad). On
//                 llvmpipe a texel buffer load measured ~20x faster than a storage-buffer
//                 load, and imageLoad compiles inline where texelFetch on a uniform texel
//                 buffer is a call that spills every vector register (docs/ARCHITECTURE.md).
//   ACCESS_SSBO:  read-only operands are storage buffers, which GPUs prefer.
// Outputs are always storage buffers. IN_* declares a binding, LD_* loads element i.
#ifdef ACCESS_TEXEL
#define IN_F32(b, n)   layout(set = 0, binding = b, r32f) uniform readonly imageBuffer n
#define IN_F32X4(b, n) layout(set = 0, binding = b, rgba32f) uniform readonly imageBuffer n
#define IN_U32(b, n)   layout(set = 0, binding = b, r32ui) uniform readonly uimageBuffer n
#define IN_U32X2(b, n) layout(set = 0, binding = b, rg32ui) uniform readonly uimageBuffer n
#define IN_U32X4(b, n) layout(set = 0, binding = b, rgba32ui) uniform readonly uimageBuffer n
#define IN_I32(b, n)   layout(set = 0, binding = b, r32i) uniform readonly iimageBuffer n
#define LD_F32(n, i)   imageLoad(n, int(i)).x
#define LD_F32X4(n, i) imageLoad(n, int(i))
#define LD_U32(n, i)   imageLoad(n, int(i)).x
#define LD_U32X2(n, i) imageLoad(n, int(i)).xy
#define LD_U32X4(n, i) imageLoad(n, int(i))
#define LD_I32(n, i)   imageLoad(n, int(i)).x
#else
#define IN_F32(b, n)   layout(set = 0, binding = b, std430) readonly buffer n##_buf { float n[]; }
#define IN_F32X4(b, n) layout(set = 0, binding = b, std430) readonly buffer n##_buf { vec4 n[]; }
#define IN_U32(b, n)   layout(set = 0, binding = b, std430) readonly buffer n##_buf { uint n[]; }
#define IN_U32X2(b, n) layout(set = 0, binding = b, std430) readonly buffer n##_buf { uvec2 n[]; }
#define IN_U32X4(b, n) layout(set = 0, binding = b, std430) readonly buffer n##_buf { uvec4 n[]; }
#define IN_I32(b, n)   layout(set = 0, binding = b, std430) readonly buffer n##_buf { int n[]; }
#define LD_F32(n, i)   n[i]
#define LD_F32X4(n, i) n[i]
#define LD_U32(n, i)   n[i]
#define LD_U32X2(n, i) n[i]
#define LD_U32X4(n, i) n[i]
#define LD_I32(n, i)   n[i]
#endif
#define OUT_F32(b, n)   layout(set = 0, binding = b, std430) writeonly buffer n##_buf { float n[]; }
#define OUT_F32X4(b, n) layout(set = 0, binding = b, std430) writeonly buffer n##_buf { vec4 n[]; }
#define OUT_U32(b, n)   layout(set = 0, binding = b, std430) writeonly buffer n##_buf { uint n[]; }
#define OUT_I32(b, n)   layout(set = 0, binding = b, std430) writeonly buffer n##_buf { int n[]; }
#define RW_F32(b, n)    layout(set = 0, binding = b, std430) buffer n##_buf { float n[]; }
#define RW_U32(b, n)    layout(set = 0, binding = b, std430) buffer n##_buf { uint n[]; }

// Workgroup size is specialisation constant 0 in every kernel.
#define DECLARE_LOCAL_SIZE layout(local_size_x_id = 0, local_size_y = 1, local_size_z = 1) in
