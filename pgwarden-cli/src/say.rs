//! Messages to stderr that never block and never panic.
//!
//! `run` and its keeper write a message before or while they stop a
//! command. A blocking write to a pipe nobody reads any more (a log
//! shipper that hung, `| less` left open) would stop them there, with the
//! command running on past the lease: a message is worth less than the
//! kill it would delay. So a message waits at most [`ROOM_WAIT`] for room
//! and what does not fit is dropped, counted, and said at the next message
//! that does get through. The exit code still says what happened.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The longest a message waits for room in stderr.
const ROOM_WAIT: Duration = Duration::from_millis(10);

/// Messages (or parts) dropped because stderr had no room.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// The descriptor messages go to: for a pipe, a second open of it in
/// non-blocking mode (its own open file description: the flag does not
/// reach the command, which shares stderr); otherwise stderr itself,
/// written only once `poll` says there is room.
fn target() -> (i32, bool) {
    static FD: OnceLock<(i32, bool)> = OnceLock::new();
    *FD.get_or_init(|| {
        // SAFETY: fstat fills a plain C struct; open takes a NUL-terminated path.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(2, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFIFO {
                let fd = libc::open(
                    c"/proc/self/fd/2".as_ptr(),
                    libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
                );
                if fd >= 0 {
                    return (fd, true);
                }
            }
        }
        (2, false)
    })
}

/// Writes `args` and a newline to stderr, without blocking for more than
/// [`ROOM_WAIT`] in all and without panicking.
pub(crate) fn line(args: fmt::Arguments<'_>) {
    let mut text = String::new();
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    if dropped > 0 {
        text.push_str(&format!(
            "pgwarden: ({dropped} earlier message(s) dropped: stderr had no room)\n"
        ));
    }
    text.push_str(&args.to_string());
    text.push('\n');
    if !write_all(text.as_bytes()) {
        DROPPED.fetch_add(1 + dropped, Ordering::Relaxed);
    }
}

/// Whether all of `b` went out before the wait ran out.
fn write_all(mut b: &[u8]) -> bool {
    let (fd, nonblocking) = target();
    let until = Instant::now() + ROOM_WAIT;
    while !b.is_empty() {
        let left = until.saturating_duration_since(Instant::now());
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut p, 1, left.as_millis() as i32) };
        if ready <= 0 || p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            return false;
        }
        // After POLLOUT, a write of at most PIPE_BUF bytes to a pipe has
        // room (only another writer's write in between could take it: the
        // non-blocking open then answers EAGAIN instead of waiting).
        let n = if nonblocking {
            b.len()
        } else {
            b.len().min(libc::PIPE_BUF)
        };
        // SAFETY: writes from a live buffer.
        let w = unsafe { libc::write(fd, b.as_ptr().cast(), n) };
        if w < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                _ => return false,
            }
        }
        b = &b[w as usize..];
    }
    true
}
