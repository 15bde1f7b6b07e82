//! [`LostReason`]: why a lease holder stopped trusting its lease (plain
//! data; errors carry it, and `pgwarden::lease` re-exports it).

use std::fmt;

/// Why a holder stopped trusting its lease.
///
/// ```no_run
/// # async fn demo(leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
/// use std::time::Duration;
/// use pgwarden::{LeaseOptions, LostReason};
///
/// let opts = LeaseOptions::new(Duration::from_secs(30));
/// if let Some(lease) = leases.acquire("report", &opts, None).await? {
///     tokio::select! {
///         reason = lease.lost() => match reason {
///             LostReason::Taken => eprintln!("another instance took it over"),
///             other => eprintln!("stopped trusting the lease: {other}"),
///         },
///         _ = tokio::time::sleep(Duration::from_secs(10)) => lease.release().await?,
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LostReason {
    /// A renewal, release or fence found the row gone or in another term:
    /// another holder took it over.
    Taken,
    /// No renewal succeeded before the local deadline (start of the last
    /// successful renewal + TTL − safety margin): the database may let
    /// another holder in soon, so this one stops trusting it now.
    Deadline,
    /// A fence found the term still ours but expired in the database.
    Expired,
    /// [`Leases::release_all`](crate::Leases::release_all) released it while
    /// its guard was still alive.
    Released,
    /// A renewal found the term ended by hand: its row still carries this
    /// term's token, with no holder ([`Leases::revoke`](crate::Leases::revoke),
    /// `pgwarden revoke`, or an `UPDATE` of the row).
    Revoked,
}

impl LostReason {
    /// The reason as used in logs and metric labels.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            LostReason::Taken => "taken",
            LostReason::Deadline => "deadline",
            LostReason::Expired => "expired",
            LostReason::Released => "released",
            LostReason::Revoked => "revoked",
        }
    }
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostReason::Taken => "taken over by another holder",
            LostReason::Deadline => "no renewal succeeded before the local deadline",
            LostReason::Expired => "expired in the database",
            LostReason::Released => "released by release_all",
            LostReason::Revoked => "revoked: the term was ended by hand (pgwarden revoke)",
        })
    }
}
