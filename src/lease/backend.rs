//! The lease layer's seam: what a backend supplies beyond the statement
//! layer ([`Backend`]), and which pools a [`Leases`](super::Leases) is
//! made from ([`LeasePool`]). Everything else of the layer (statements,
//! gathering, renewals, the lost signal, the fence check, the scheduler) is
//! written once over `B: Backend` and compiled per backend (static
//! dispatch; `B` defaults to the deadpool pool, so the deadpool code is the
//! code it was).
//!
//! A backend supplies:
//!
//! - whether the pool's connections are known to keep their server session
//!   (lease statements are then prepared, and cancelled by pid), and the
//!   pooler detection that finds out;
//! - the transaction [`LeaseHandle::fence`](super::LeaseHandle::fence)
//!   takes (`acquire::FenceTx`, next to the fence: how the fence check runs
//!   in it, what the guard dereferences to, how it commits);
//! - nothing else: checkouts, statements and cancellation go through the
//!   pool shell (`Shared<B>`) and the statement layer (`Client::exec`).
//!
//! The deadpool implementation is here; sqlx's is in `crate::sqlx`
//! (`sqlx/leases.rs`, one source for both sqlx versions).

use std::future::Future;
use std::sync::Arc;

use crate::error::Error;
use crate::pool::{Shared, Source};
use crate::pooler::PoolerMode;

/// A pool a lease table runs on. Public only because the lease types name
/// it as their parameter's bound; not reachable from outside the crate
/// (sealed). Implemented by deadpool's pool and (features `sqlx-0_8`,
/// `sqlx-0_9`) sqlx's `PgPool`.
#[allow(unreachable_pub, private_bounds)]
pub trait Backend: Source {
    /// pgwarden's pool over it.
    type Pool: LeasePool<Backend = Self> + Clone + Send + Sync + 'static;

    /// The backend keeps a named prepared statement it sends (sqlx 0.8
    /// with its statement cache off names every persistent statement and
    /// never closes it): lease statements are prepared only then (and
    /// where the pool's connections keep their server session).
    fn names_statements(pool: &Self::Pool) -> bool;

    /// The pooler detection to run in the background before the first
    /// lease statement, when the pool does not know its mode yet; `None`
    /// when it does.
    fn detect_pooler(
        pool: &Self::Pool,
    ) -> Option<impl Future<Output = Result<PoolerMode, Error>> + Send + 'static>;
}

/// A pgwarden pool a [`Leases`](super::Leases) can be made from:
/// [`crate::Pool`], and `pgwarden::sqlx::Pool` (features `sqlx-0_8`,
/// `sqlx-0_9`). Sealed, as [`Backend`].
#[allow(unreachable_pub, private_bounds, private_interfaces)]
pub trait LeasePool {
    /// The pool it wraps.
    type Backend: Backend;
    /// Its shared core.
    fn shared(&self) -> &Arc<Shared<Self::Backend>>;
    /// A clone of it, as the lease layer keeps it.
    fn pool(&self) -> <Self::Backend as Backend>::Pool;
}

// --- deadpool-postgres ------------------------------------------------------

impl LeasePool for crate::Pool {
    type Backend = deadpool_postgres::Pool;

    #[allow(private_interfaces)]
    fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    fn pool(&self) -> crate::Pool {
        self.clone()
    }
}

impl Backend for deadpool_postgres::Pool {
    type Pool = crate::Pool;

    /// tokio-postgres keeps them in deadpool's statement cache.
    #[inline]
    fn names_statements(_: &crate::Pool) -> bool {
        true
    }

    fn detect_pooler(
        pool: &crate::Pool,
    ) -> Option<impl Future<Output = Result<PoolerMode, Error>> + Send + 'static> {
        if pool.pooler() != PoolerMode::Auto {
            return None;
        }
        let pool = pool.clone();
        Some(async move { pool.detect_pooler().await })
    }
}
