//! Lanes, priorities and the session-lock policy: the vocabulary of admission.

use std::fmt;

/// Why a connection is checked out.
///
/// Each lane has a reserved minimum and a maximum, set with
/// [`PoolBuilder::lane`](crate::PoolBuilder::lane), whose docs give the
/// defaults; [`Pool::status`](crate::Pool::status) shows them.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// let client = pool.get().await?;
/// assert_eq!(client.lane(), pgwarden::Lane::Request);
/// # Ok(()) }
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    /// Ordinary work: handlers, and the work done under a lock or a lease.
    /// The default lane of [`crate::Pool::get`].
    Request,
    /// A connection pinned by a session advisory lock.
    SessionLock,
    /// pgwarden's own background statements: the `pg_locks` census, pooler
    /// detection, the lease-table install. No reserve by default; it never
    /// takes the probe's.
    Control,
    /// The readiness probe ([`crate::Pool::readiness`]): a reserve (1 by
    /// default) that no other lane may take, so the probe answers whatever
    /// the rest of the pool is doing.
    Probe,
    /// Lease statements (acquire, renew, release): bounded, so that a storm
    /// of lease calls never holds more than its maximum; renewals and
    /// releases go before acquisitions, and acquisitions never hold the
    /// lane's last slot.
    Lease,
}

impl Lane {
    /// How many lanes there are.
    pub const COUNT: usize = 5;

    /// Every lane, in index order (the order of [`crate::Status::lanes`]).
    pub const ALL: [Lane; Lane::COUNT] = [
        Lane::Request,
        Lane::SessionLock,
        Lane::Control,
        Lane::Probe,
        Lane::Lease,
    ];

    /// The lane's name as used in logs and metric labels.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Lane::Request => "request",
            Lane::SessionLock => "session_lock",
            Lane::Control => "control",
            Lane::Probe => "probe",
            Lane::Lease => "lease",
        }
    }

    /// The lane's position in [`Lane::ALL`].
    pub(crate) const fn idx(self) -> usize {
        match self {
            Lane::Request => 0,
            Lane::SessionLock => 1,
            Lane::Control => 2,
            Lane::Probe => 3,
            Lane::Lease => 4,
        }
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which checkouts of a lane go first.
///
/// `Urgent` checkouts are served before every `Normal` waiter (of any lane),
/// and in the lease lane `Normal` ones (acquisitions) never hold the slot
/// kept for `Urgent` ones (renewals, releases). Between them, a lane's
/// urgent reservation is met only by urgent checkouts.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Priority {
    /// Short statements that keep something alive: lease renewal and release.
    Urgent,
    /// Everything else.
    Normal,
}

impl Priority {
    pub(crate) const fn idx(self) -> usize {
        match self {
            Priority::Urgent => 0,
            Priority::Normal => 1,
        }
    }
}

/// What a session-lock checkout past its budget gets.
///
/// ```no_run
/// # fn demo(deadpool: deadpool_postgres::Pool) -> Result<(), pgwarden::BuildError> {
/// // Admit session locks past the budget, with a warning and a counter.
/// let pool = pgwarden::Pool::builder(deadpool)
///     .policy(pgwarden::BudgetPolicy::Warn)
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum BudgetPolicy {
    /// Refuse with [`CheckoutError::BudgetExhausted`](crate::CheckoutError::BudgetExhausted). Default.
    #[default]
    Refuse,
    /// Admit, log once per call site through `tracing`, and count it; up to the
    /// hard floor (the other lanes' reservations and one connection for the
    /// work under the locks), past which it refuses too.
    Warn,
}

impl std::fmt::Display for BudgetPolicy {
    /// `refuse` or `warn`, as in logs and metric labels.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BudgetPolicy::Refuse => "refuse",
            BudgetPolicy::Warn => "warn",
        })
    }
}
