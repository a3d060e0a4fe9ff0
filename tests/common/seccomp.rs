//! seccomp filters a test installs in the backend (between fork and exec) to make system
//! calls fail: io_uring denied, fallocate refused.

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_RET_K: u16 = 0x06;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;

/// Install a seccomp filter program in this process (between fork and exec: only
/// async-signal-safe prctl calls).
fn install_seccomp(prog: &[libc::sock_filter]) -> std::io::Result<()> {
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: plain prctl calls with a valid filter program that outlives them.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            || libc::prctl(libc::PR_SET_SECCOMP, 2, &fprog as *const libc::sock_fprog) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Install a seccomp filter making io_uring_setup fail with EPERM (x86_64 syscall 425).
pub fn deny_io_uring_setup() -> std::io::Result<()> {
    const NR_IO_URING_SETUP: u32 = 425;
    let f = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let prog = [
        // seccomp_data.arch at offset 4: only filter x86_64 calls.
        f(BPF_LD_W_ABS, 0, 0, 4),
        f(BPF_JMP_JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
        // seccomp_data.nr at offset 0.
        f(BPF_LD_W_ABS, 0, 0, 0),
        f(BPF_JMP_JEQ_K, 0, 1, NR_IO_URING_SETUP),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | libc::EPERM as u32),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ];
    install_seccomp(&prog)
}

/// Install a seccomp filter making `fallocate` with mode 0 fail with `errno` (x86_64 syscall
/// 285; other modes, such as punching holes, still work).
pub fn fail_fallocate_mode0(errno: i32) -> std::io::Result<()> {
    const NR_FALLOCATE: u32 = 285;
    let f = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let prog = [
        f(BPF_LD_W_ABS, 0, 0, 4),
        f(BPF_JMP_JEQ_K, 0, 5, AUDIT_ARCH_X86_64),
        f(BPF_LD_W_ABS, 0, 0, 0),
        f(BPF_JMP_JEQ_K, 0, 3, NR_FALLOCATE),
        // seccomp_data.args[1] (mode), low half, at offset 16 + 8.
        f(BPF_LD_W_ABS, 0, 0, 24),
        f(BPF_JMP_JEQ_K, 0, 1, 0),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno as u32),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ];
    install_seccomp(&prog)
}

/// Install a seccomp filter making `fcntl(fd, F_OFD_SETLK, ...)` fail with `errno` (x86_64
/// syscall 72, command 37): a file system without open-file-description locks.
pub fn fail_ofd_setlk(errno: i32) -> std::io::Result<()> {
    const NR_FCNTL: u32 = 72;
    const F_OFD_SETLK: u32 = 37;
    let f = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let prog = [
        f(BPF_LD_W_ABS, 0, 0, 4),
        f(BPF_JMP_JEQ_K, 0, 5, AUDIT_ARCH_X86_64),
        f(BPF_LD_W_ABS, 0, 0, 0),
        f(BPF_JMP_JEQ_K, 0, 3, NR_FCNTL),
        // seccomp_data.args[1] (the command), low half, at offset 16 + 8.
        f(BPF_LD_W_ABS, 0, 0, 24),
        f(BPF_JMP_JEQ_K, 0, 1, F_OFD_SETLK),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno as u32),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ];
    install_seccomp(&prog)
}
