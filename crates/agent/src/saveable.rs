//! Whether the sandbox's processes can be written to disk as they are, asked by the host before
//! it checkpoints a gvisor sandbox (`GET` [`crate::SAVEABLE_PATH`]).
//!
//! The gVisor release the gvisor tier runs (runsc 2022) ends the whole sandbox when its
//! checkpoint meets a TCP socket that something still waits on across calls: an epoll set
//! watching it (asyncio, tornado, node, ZeroMQ and most servers). A blocking `accept`, `poll`
//! or `select` is interrupted by the save and does not count. So the host asks first, and a
//! sandbox this finds a blocker in is paused in place instead of lost.
//!
//! What is read is what any process inside may read: `/proc/net/tcp{,6}` for the TCP sockets'
//! inodes and each process's `fd` links. The agent itself is left out (its epoll watches its
//! link and its children's pipes, never a TCP socket of the sandbox's).

use std::collections::HashSet;
use std::fs;
use std::path::Path;

/// The first process found that holds an epoll set and a TCP socket, as "process PID (NAME)".
pub fn blocker() -> Option<String> {
    let tcp = tcp_inodes();
    if tcp.is_empty() {
        return None;
    }
    let own = std::process::id().to_string();
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == own || !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if waits_through_epoll(&entry.path(), &tcp) {
            let comm = fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            return Some(format!("process {name} ({}) waits on a TCP socket through epoll", comm.trim()));
        }
    }
    None
}

/// Whether the process at `proc_dir` holds both an epoll set and one of the `tcp` sockets.
fn waits_through_epoll(proc_dir: &Path, tcp: &HashSet<u64>) -> bool {
    let Ok(fds) = fs::read_dir(proc_dir.join("fd")) else { return false };
    let (mut epoll, mut socket) = (false, false);
    for fd in fds.flatten() {
        let Ok(target) = fs::read_link(fd.path()) else { continue };
        let target = target.to_string_lossy();
        epoll |= target == "anon_inode:[eventpoll]";
        socket |= socket_inode(&target).is_some_and(|i| tcp.contains(&i));
        if epoll && socket {
            return true;
        }
    }
    false
}

/// The inode of a `socket:[N]` descriptor link.
fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
}

/// The inodes of every TCP socket in the sandbox's network stack, listening or not.
fn tcp_inodes() -> HashSet<u64> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|p| fs::read_to_string(p).ok())
        .flat_map(|table| parse_inodes(&table))
        .collect()
}

/// The `inode` column (the tenth) of a `/proc/net/tcp` table, header skipped.
fn parse_inodes(table: &str) -> Vec<u64> {
    table.lines().skip(1).filter_map(|l| l.split_whitespace().nth(9)?.parse().ok()).filter(|&i| i != 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_inode_column_of_a_tcp_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n \
            133: 0100007F:595E 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 134 1 0000000000000000 0 0 0 0 -1\n \
            151: 0100007F:4691 0100007F:595E 06 00000000:00000000 00:00000000 00000000     0        0 0 3 0000000000000000\n";
        assert_eq!(parse_inodes(table), vec![134]);
        assert_eq!(socket_inode("socket:[134]"), Some(134));
        assert_eq!(socket_inode("anon_inode:[eventpoll]"), None);
    }

    #[test]
    fn finds_a_process_waiting_on_a_tcp_socket_through_epoll() {
        let me = Path::new("/proc/self");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        // SAFETY: epoll_create1 with no flags; the descriptor is closed below.
        let ep = unsafe { libc::epoll_create1(0) };
        assert!(ep >= 0);
        let tcp = tcp_inodes();
        assert!(waits_through_epoll(me, &tcp), "an epoll set and a listening TCP socket in one process");
        drop(listener);
        // The socket gone from the table, the epoll set alone does not block a save.
        assert!(!waits_through_epoll(me, &tcp_inodes()));
        // SAFETY: closing the epoll descriptor made above.
        unsafe { libc::close(ep) };
    }
}
