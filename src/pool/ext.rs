//! The extension slot: how the layers above the pool (locks, pooler
//! detection, the census, a backend's own per-pool state) keep per-pool
//! state and settings without the pool knowing them, keyed by type. Its
//! own file so that the seam ([`Source`](super::source::Source)) can hand
//! it to a backend as the pool is built, below the pool's shared core.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

/// One value per type, stored as `dyn Any`: the pool does not know what it
/// holds. A handful of entries at most, so a vector beats a map. Public
/// only because [`Source`](super::source::Source) names it; not reachable
/// from outside the crate.
#[allow(unreachable_pub)]
#[derive(Default)]
pub struct Extensions(Mutex<Vec<Arc<dyn Any + Send + Sync>>>);

impl Extensions {
    /// The value of type `T`, inserted as `T::default()` on first use.
    pub(crate) fn get<T: Any + Send + Sync + Default>(&self) -> Arc<T> {
        let mut v = self.0.lock();
        if let Some(t) = v.iter().find_map(|e| e.clone().downcast::<T>().ok()) {
            return t;
        }
        let t = Arc::new(T::default());
        v.push(t.clone());
        t
    }

    /// Sets the value of type `T`, replacing any earlier one.
    pub(crate) fn set<T: Any + Send + Sync>(&mut self, value: T) {
        let v = self.0.get_mut();
        v.retain(|e| !e.is::<T>());
        v.push(Arc::new(value));
    }
}

impl fmt::Debug for Extensions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Extensions({})", self.0.lock().len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default, Debug, PartialEq)]
    struct A(u32);

    #[test]
    fn one_value_per_type() {
        let mut e = Extensions::default();
        assert_eq!(*e.get::<A>(), A(0));
        e.set(A(3));
        assert_eq!(*e.get::<A>(), A(3));
        assert!(Arc::ptr_eq(&e.get::<A>(), &e.get::<A>()));
        assert_eq!(*e.get::<u8>(), 0);
        assert_eq!(e.0.lock().len(), 2);
    }
}
