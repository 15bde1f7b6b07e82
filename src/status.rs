//! [`Status`]: the pool at one moment, as plain data (errors carry it).

use std::fmt;

use crate::admission::Lane;

/// One lane of [`Status`].
///
/// ```no_run
/// # fn demo(pool: pgwarden::Pool) {
/// let locks = pool.status().lane(pgwarden::Lane::SessionLock);
/// println!("session locks pin {} of {} connections", locks.in_use, locks.max);
/// # }
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LaneStatus {
    /// The lane.
    pub lane: Lane,
    /// Connections of this lane checked out now.
    pub in_use: usize,
    /// Of those, connections being released (a dropped session-lock guard
    /// whose unlock is in flight): they come back within the unlock timeout.
    pub releasing: usize,
    /// Checkouts of this lane waiting now.
    pub waiting: usize,
    /// Its reservation.
    pub reserved: usize,
    /// Its maximum.
    pub max: usize,
}

/// The pool at one moment, as [`crate::Pool::status`] and timeout errors give it.
///
/// It carries deadpool's field names too (`max_size`, `size`, `available`,
/// `waiting`, as in `deadpool_postgres::Status`), so that code written
/// against deadpool's `Pool::status()` reads the same numbers:
///
/// ```no_run
/// # fn demo(pool: pgwarden::Pool) {
/// let s = pool.status();
/// println!("{} of {} open, {} idle, {} waiting", s.size, s.max_size, s.available, s.waiting);
/// # }
/// ```
///
/// ```no_run
/// # fn demo(pool: pgwarden::Pool) {
/// let s = pool.status();
/// if s.waiting > 0 {
///     tracing::warn!(status = %s, "checkouts are queueing");
/// }
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The pool's maximum size `N`.
    pub max: usize,
    /// The pool's maximum size `N`: the same as [`Status::max`], under
    /// deadpool's name.
    pub max_size: usize,
    /// Physical connections open now (deadpool's `size`).
    pub size: usize,
    /// Physical connections idle in the pool.
    pub idle: usize,
    /// Physical connections idle in the pool: the same as [`Status::idle`],
    /// under deadpool's name (what deadpool's `available` counts: open
    /// connections not checked out).
    pub available: usize,
    /// Connections checked out through pgwarden, all lanes.
    pub in_use: usize,
    /// Checkouts waiting, all lanes (deadpool's `waiting`: pgwarden's
    /// callers wait in its admission queues, never inside deadpool).
    pub waiting: usize,
    /// Per lane, in [`Lane::ALL`] order.
    pub lanes: [LaneStatus; Lane::COUNT],
}

impl Status {
    /// One lane's status.
    pub fn lane(&self, lane: Lane) -> LaneStatus {
        self.lanes[lane.idx()]
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "total {}, open {}, idle {}, in use {} (",
            self.max, self.size, self.idle, self.in_use
        )?;
        for (i, l) in self.lanes.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} {}/{}", l.lane, l.in_use, l.max)?;
            if l.releasing > 0 {
                write!(f, " ({} releasing)", l.releasing)?;
            }
        }
        write!(f, "), waiting {}", self.waiting)?;
        if self.waiting > 0 {
            f.write_str(" (")?;
            let mut first = true;
            for l in self.lanes.iter().filter(|l| l.waiting > 0) {
                if !first {
                    f.write_str(", ")?;
                }
                first = false;
                write!(f, "{} {}", l.lane, l.waiting)?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}
