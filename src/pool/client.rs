//! [`Client`]: a checked-out connection.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::panic::Location;
use std::time::Instant;

use deadpool_postgres::Object;

use super::shared::{ObjectId, Permit};
use crate::admission::Lane;

/// A checked-out connection. Derefs to [`deadpool_postgres::Client`], so code
/// written against deadpool runs unchanged; returns to the pool on drop.
///
/// Knows its lane, its backend pid, where it was checked out and since when.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), Box<dyn std::error::Error>> {
/// use pgwarden::{Client, Pool};
///
/// async fn count(client: &Client) -> Result<i64, tokio_postgres::Error> {
///     Ok(client.query_one("SELECT count(*) FROM jobs", &[]).await?.get(0))
/// }
/// let client = pool.get().await?;
/// println!("{} jobs, pid {}, lane {}", count(&client).await?, client.pid(), client.lane());
/// # Ok(()) }
/// ```
pub struct Client {
    // Field order matters: the object goes back to deadpool before the permit
    // is released, so an admitted checkout never waits inside deadpool.
    pub(super) obj: Option<deadpool_postgres::Client>,
    pub(super) permit: Permit,
    pub(super) pid: i32,
    pub(super) site: &'static Location<'static>,
    pub(super) since: Instant,
    pub(super) object: ObjectId,
}

impl Client {
    /// The lane it was checked out on.
    pub fn lane(&self) -> Lane {
        self.permit.lane
    }

    /// The backend pid of its PostgreSQL session (behind a transaction
    /// pooler: the pid seen at first checkout, which may change).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Where it was checked out.
    pub fn site(&self) -> &'static Location<'static> {
        self.site
    }

    /// When it was checked out.
    pub fn since(&self) -> Instant {
        self.since
    }

    /// Closes the physical connection instead of returning it to the pool:
    /// PostgreSQL ends the session, and every session lock with it.
    pub fn discard(mut self) {
        if let Some(obj) = self.obj.take() {
            self.permit.shared.state.lock().pids.remove(&self.object);
            drop(Object::take(obj));
        }
    }

    /// A connection deadpool made for this checkout (never recycled).
    pub(super) fn is_new(&self) -> bool {
        self.obj
            .as_ref()
            .is_some_and(|o| Object::metrics(o).recycle_count == 0)
    }

    /// Its owner let go and its return is under way (a dropped session-lock
    /// guard whose unlock is in flight): a checkout of its lane refused only
    /// because of it waits for it instead.
    pub(crate) fn mark_releasing(&self) {
        self.permit.shared.mark_releasing(self.permit.slot);
    }

    /// Sets what the checkout is for, shown in long-hold warnings.
    pub(crate) fn set_note(&self, note: Option<String>) {
        if let Some(c) = self
            .permit
            .shared
            .state
            .lock()
            .checkouts
            .get_mut(self.permit.slot)
        {
            c.note = note;
        }
    }

    fn client(&self) -> &deadpool_postgres::Client {
        // infallible: `obj` is Some until drop or `discard`, which consume self.
        self.obj.as_ref().expect("connection present until drop") // infallible
    }
}

impl Deref for Client {
    type Target = deadpool_postgres::Client;
    fn deref(&self) -> &Self::Target {
        self.client()
    }
}

impl DerefMut for Client {
    fn deref_mut(&mut self) -> &mut Self::Target {
        // infallible: `obj` is Some until drop or `discard`, which consume self.
        self.obj.as_mut().expect("connection present until drop") // infallible
    }
}

impl AsRef<deadpool_postgres::Client> for Client {
    fn as_ref(&self) -> &deadpool_postgres::Client {
        self.client()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Some(obj) = &self.obj {
            let shared = &self.permit.shared;
            shared
                .metrics
                .lane(self.permit.lane)
                .hold
                .record(self.since.elapsed().as_secs_f64());
            if obj.is_closed() {
                shared.state.lock().pids.remove(&self.object);
            }
        }
        // The fields drop next, in place: the object goes back to deadpool,
        // then the permit returns to the budget.
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("lane", &self.permit.lane)
            .field("pid", &self.pid)
            .field("site", &format_args!("{}", self.site))
            .field("age", &self.since.elapsed())
            .finish()
    }
}
