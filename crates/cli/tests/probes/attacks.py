"""Escape attempts run inside a sandbox, as root of the sandbox. Each entry records the errno a
syscall failed with (0 = it succeeded). The Rust test decides what counts as contained.

Arguments are chosen so that, without the sandbox's filters, most calls would succeed or fail
with a *different* errno (EINVAL, EFAULT, EBADF): EPERM then shows the filter at work."""
import ctypes, errno, json, os, socket, struct, fcntl, sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buf = ctypes.create_string_buffer(4096)
ptr = ctypes.addressof(buf)
res = {}


def sc(name, nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    res[name] = 0 if r >= 0 else ctypes.get_errno()
    if r >= 0 and name in ("io_uring_setup", "userfaultfd", "bpf", "perf_event_open", "fsopen", "open_tree", "pidfd_getfd"):
        os.close(r)


def sock(name, *a):
    try:
        socket.socket(*a).close()
        res[name] = 0
    except OSError as e:
        res[name] = e.errno


CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x20000, 0x40000000, 17

sc("io_uring_setup", 425, 4, ptr)
sc("io_uring_enter", 426, 0, 0, 0, 0, 0, 0)
sc("io_uring_register", 427, 0, 0, 0, 0)
sc("bpf", 321, 0, ptr, 64)
sc("perf_event_open", 298, ptr, 0, -1, -1, 0)
sc("userfaultfd", 323, 0)
sc("keyctl", 250, 0, -3, 0, 0, 0)          # KEYCTL_GET_KEYRING_ID of the session keyring
sc("add_key", 248, ctypes.addressof(ctypes.create_string_buffer(b"user")), ctypes.addressof(ctypes.create_string_buffer(b"k")), ptr, 1, -3)
sc("request_key", 249, ctypes.addressof(ctypes.create_string_buffer(b"user")), ctypes.addressof(ctypes.create_string_buffer(b"k")), 0, 0)
sc("kexec_load", 246, 0, 0, 0, 0)
sc("kexec_file_load", 320, -1, -1, 0, 0, 0)
sc("init_module", 175, ptr, 16, ptr)
sc("finit_module", 313, -1, ptr, 0)
sc("delete_module", 176, ptr, 0)
sc("open_by_handle_at", 304, -100, ptr, 0)
sc("name_to_handle_at", 303, -100, ctypes.addressof(ctypes.create_string_buffer(b"/etc/passwd")), ptr, ptr, 0)
sc("mount", 165, ctypes.addressof(ctypes.create_string_buffer(b"none")), ctypes.addressof(ctypes.create_string_buffer(b"/mnt")), ctypes.addressof(ctypes.create_string_buffer(b"tmpfs")), 0, 0)
sc("umount2", 166, ctypes.addressof(ctypes.create_string_buffer(b"/proc")), 2)
sc("fsopen", 430, ctypes.addressof(ctypes.create_string_buffer(b"tmpfs")), 0)
sc("fsconfig", 431, -1, 0, 0, 0, 0)
sc("fsmount", 432, -1, 0, 0)
sc("fspick", 433, -100, ctypes.addressof(ctypes.create_string_buffer(b"/")), 0)
sc("open_tree", 428, -100, ctypes.addressof(ctypes.create_string_buffer(b"/")), 1)
sc("move_mount", 429, -1, 0, -1, 0, 0)
sc("mount_setattr", 442, -1, 0, 0, 0, 0)
sc("pivot_root", 155, ctypes.addressof(ctypes.create_string_buffer(b"/tmp")), ctypes.addressof(ctypes.create_string_buffer(b"/tmp")))
sc("unshare_user", 272, CLONE_NEWUSER)
sc("unshare_mount", 272, CLONE_NEWNS)
sc("unshare_net", 272, CLONE_NEWNET)
try:
    sc("setns", 308, os.open("/proc/self/ns/mnt", os.O_RDONLY), 0)
except OSError as e:  # a kernel without mount namespace files (gVisor's) has nothing to join
    res["setns"] = e.errno
sc("clone_newuser", 56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
sc("clone3", 435, ptr, 88)
# PTRACE_TRACEME in a child: once traced, a process stops at its next signal, so the probe
# itself must not be the tracee.
pid = os.fork()
if pid == 0:
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(101), ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0))
    os._exit(0 if r >= 0 else ctypes.get_errno())
res["ptrace_traceme"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
sc("process_vm_readv", 310, os.getpid(), 0, 0, 0, 0, 0)
sc("process_vm_writev", 311, os.getpid(), 0, 0, 0, 0, 0)
sc("kcmp", 312, os.getpid(), os.getpid(), 0, 0, 0)
sc("pidfd_getfd", 438, -1, 0, 0)
sc("acct", 163, 0)
sc("swapon", 167, ctypes.addressof(ctypes.create_string_buffer(b"/tmp/swap")), 0)
sc("swapoff", 168, ctypes.addressof(ctypes.create_string_buffer(b"/tmp/swap")))
sc("syslog", 103, 10, 0, 0)                  # SYSLOG_ACTION_SIZE_BUFFER
sc("quotactl", 179, 0, 0, 0, 0)
sc("lookup_dcookie", 212, 0, ptr, 16)
sc("iopl", 172, 3)
sc("ioperm", 173, 0x80, 1, 1)
sc("clock_settime", 227, 0, ptr)
sc("settimeofday", 164, ptr, 0)
sc("adjtimex", 159, ptr)                     # modes = 0: a read, allowed to anyone without a filter
sc("clock_adjtime", 305, 0, ptr)
sc("reboot", 169, 0xfee1dead, 0x28121969, 0x1234567, 0)
sc("personality_read_implies_exec", 135, 0x0400000)
sc("personality_addr_no_randomize", 135, 0x0040000)
sc("fanotify_init", 300, 0, 0)
sc("modify_ldt", 154, 0, ptr, 16)

sock("af_packet", 17, socket.SOCK_RAW, 0)
sock("af_key", 15, socket.SOCK_RAW, 2)
sock("af_alg", 38, socket.SOCK_SEQPACKET, 0)
sock("af_vsock", 40, socket.SOCK_STREAM, 0)
sock("af_netlink_audit", 16, socket.SOCK_RAW, 9)
sock("af_netlink_uevent", 16, socket.SOCK_DGRAM, 15)
sock("af_netlink_route", 16, socket.SOCK_RAW, 0)
sock("inet_raw", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
sock("inet6_raw", socket.AF_INET6, socket.SOCK_RAW, 58)
sock("inet_tcp", socket.AF_INET, socket.SOCK_STREAM, 0)
sock("unix", socket.AF_UNIX, socket.SOCK_STREAM, 0)

# Terminal input injection.
try:
    m = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
    try:
        fcntl.ioctl(m, 0x5412, b"x")       # TIOCSTI
        res["tiocsti"] = 0
    except OSError as e:
        res["tiocsti"] = e.errno
    try:
        fcntl.ioctl(m, 0x541C, b"\x02")    # TIOCLINUX
        res["tioclinux"] = 0
    except OSError as e:
        res["tioclinux"] = e.errno
except OSError as e:
    res["tiocsti"] = res["tioclinux"] = e.errno


def try_write(name, path, data=b"x"):
    try:
        with open(path, "wb") as f:
            f.write(data)
        res[name] = 0
    except OSError as e:
        res[name] = e.errno


def try_read(name, path):
    try:
        with open(path, "rb") as f:
            res[name] = len(f.read(65536))
    except OSError as e:
        res[name] = -e.errno


try_write("write_proc_sys_hostname", "/proc/sys/kernel/hostname", b"pwned")
try_write("write_sysrq_trigger", "/proc/sysrq-trigger", b"h")
try_write("write_core_pattern", "/proc/sys/kernel/core_pattern", b"|/tmp/x")
try_read("read_kcore", "/proc/kcore")
try_read("read_keys", "/proc/keys")
try_read("read_timer_list", "/proc/timer_list")
try_write("overwrite_agent_exe", "/proc/1/exe", b"\x7fELF")
try:
    os.mknod("/tmp/sda", 0o600 | 0o060000, os.makedev(8, 0))
    try_read("read_block_device", "/tmp/sda")
except OSError as e:
    res["read_block_device"] = -e.errno

# chroot escape: chroot into a subdirectory, climb, chroot again; must end in the sandbox root.
pid = os.fork()
if pid == 0:
    try:
        os.makedirs("/tmp/jail", exist_ok=True)
        fd = os.open("/", os.O_RDONLY)
        os.chroot("/tmp/jail")
        os.fchdir(fd)
        for _ in range(64):
            os.chdir("..")
        os.chroot(".")
        sys.stdout.write(json.dumps({"chroot_escape_root": sorted(os.listdir("/"))}) + "\n")
        sys.stdout.flush()
    finally:
        os._exit(0)
os.waitpid(pid, 0)

status = open("/proc/self/status").read()
caps = [l for l in status.splitlines() if l.startswith("CapBnd:")][0].split()[1]
res["cap_bnd"] = int(caps, 16)
res["seccomp_mode"] = int([l for l in status.splitlines() if l.startswith("Seccomp:")][0].split()[1])
print(json.dumps(res))
