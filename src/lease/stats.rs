//! [`LeaseStats`]: the counts of a [`Leases`](super::Leases) instance.

use std::time::Duration;

/// What a [`Leases`](super::Leases) instance has done, for logs and tests.
///
/// ```no_run
/// # fn demo(leases: pgwarden::Leases) {
/// let s = leases.stats();
/// println!("{} held, {} renewal failures", s.held, s.renewal_failures);
/// # }
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStats {
    /// Leases held now.
    pub held: usize,
    /// Statements sent: acquisitions, busy checks, renewals, releases,
    /// fences, purges and installs.
    pub statements: u64,
    /// Renewal statements sent (each renews a batch).
    pub renewal_statements: u64,
    /// Lease renewals that succeeded, summed over batches.
    pub renewed: u64,
    /// Leases in the last renewal statement that succeeded.
    pub last_batch: usize,
    /// How long that statement took, checkout included.
    pub last_renewal: Duration,
    /// Renewal attempts that failed (a database or pool error, a timeout):
    /// retried with back-off until the local deadline.
    pub renewal_failures: u64,
    /// Rows deleted by purges.
    pub purged: u64,
    /// Purge statements sent.
    pub purge_statements: u64,
    /// Take-overs of an expired lease that met a lock on its row and
    /// answered busy (see [`Leases::acquire`](super::Leases::acquire)).
    pub takeovers_blocked: u64,
}
