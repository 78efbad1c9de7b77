//! Whether this CPU and OS run the AMX kernel: CPUID's feature bits, and Linux's permission to use
//! the tile data.
//!
//! Why separate: detection runs once per process, before any kernel, and is the only part of the
//! kernel that talks to the OS (a system call); the kernel itself only trusts its answer.

#[cfg(target_os = "linux")]
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use crate::gemv::avx512;

/// Whether this CPU and OS run the kernel: CPUID's AMX-TILE and AMX-INT8, AVX-512 for the float
/// steps, and Linux's permission to use the tile data (asked for once per process; never assumed).
pub fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| cpu_has_amx_int8() && avx512::supported() && request_tile_permission())
}

/// CPUID leaf 7, sub-leaf 0, EDX bit 24 (AMX-TILE) and bit 25 (AMX-INT8). (`is_x86_feature_detected!`
/// does not take the AMX names on stable Rust.)
fn cpu_has_amx_int8() -> bool {
    // SAFETY: CPUID exists on every x86-64 CPU (the `unsafe` is for compilers before 1.94, where
    // the intrinsics were unsafe functions).
    #[allow(unused_unsafe)]
    let (max_leaf, edx) = unsafe { (__cpuid(0).eax, __cpuid_count(7, 0).edx) };
    max_leaf >= 7 && edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

/// Linux's `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: until a process has asked, the
/// kernel does not save the 8 KB of tile data on a context switch, and the first tile instruction
/// faults (SIGILL). The permission is the process's (every thread's, the pool's included).
#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: the arch_prctl system call reads only its two integer arguments and writes only rax
    // (the result) and rcx / r11 (which `syscall` itself clobbers, declared here); it touches no
    // memory of this process and does not use the stack.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

/// Elsewhere: not supported (how another OS grants the tile state is not known here).
#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}
