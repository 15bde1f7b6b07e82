//! Pool names are unique among the live pools of a process by default, so
//! that two pools never silently share the `pool` label of their metrics:
//! an unnamed pool is `default`, then `default-2`, `default-3`… A name given
//! explicitly is kept as given; when another live pool already has it, that
//! is logged as a warning (their series add up under one label).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

fn live() -> &'static Mutex<HashMap<Arc<str>, usize>> {
    static LIVE: OnceLock<Mutex<HashMap<Arc<str>, usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// A name held by a live pool; given back on drop.
#[derive(Debug)]
pub(crate) struct Claim(Arc<str>);

impl Claim {
    /// Claims `explicit`, or the first free default name.
    pub(crate) fn new(explicit: Option<&str>) -> Claim {
        // A poisoned registry only means another thread panicked while
        // holding it: the map itself is always consistent.
        let mut live = live().lock().unwrap_or_else(|e| e.into_inner());
        let name: Arc<str> = match explicit {
            Some(n) => n.into(),
            None => (1usize..)
                .map(|i| -> Arc<str> {
                    if i == 1 {
                        "default".into()
                    } else {
                        format!("default-{i}").into()
                    }
                })
                .find(|n| live.get(n).copied().unwrap_or(0) == 0)
                .unwrap_or_else(|| "default".into()),
        };
        let n = live.entry(name.clone()).or_insert(0);
        *n += 1;
        if *n > 1 {
            tracing::warn!(
                pool = %name,
                live = *n,
                "another live pool has this name: their metric series share the pool label; \
                 give each pool its own name"
            );
        }
        Claim(name)
    }

    pub(crate) fn name(&self) -> Arc<str> {
        self.0.clone()
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut live = live().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = live.get_mut(&self.0) {
            *n -= 1;
            if *n == 0 {
                live.remove(&self.0);
            }
        }
    }
}
