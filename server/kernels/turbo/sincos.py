"""cos and sin of float32 angles inside Triton kernels: the key offset's turn (key_offset.py) in the store
and decode kernels, computed the same way in both."""

import triton
import triton.language as tl

# 2 pi rounded to float32 and what that rounding lost: a Cody-Waite reduction of p * theta_f (up to
# ~1.3e5 rad at 128K) to [-pi, pi], where the GPU's approximate sin/cos are accurate.
TWO_PI_HI = tl.constexpr(6.2831854820251465)
TWO_PI_LO = tl.constexpr(-1.7484556000744883e-07)
INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def sincos(angle, ASM: tl.constexpr):
    """(cos, sin) of float32 angles. With ASM (CUDA) the MUFU approximations after a reduction to [-pi, pi]
    (absolute error about 1e-6 there; libdevice's accurate ones cost some 40 instructions each), else exact.
    The reduction needs a real FMA, which the CPU interpreter does not have."""
    if ASM:
        turns = tl.floor(angle * INV_TWO_PI + 0.5)
        angle = tl.fma(turns, -TWO_PI_LO, tl.fma(turns, -TWO_PI_HI, angle))
        cos = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [angle], dtype=tl.float32, is_pure=True,
                                        pack=1)
        sin = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [angle], dtype=tl.float32, is_pure=True,
                                        pack=1)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    return cos, sin
