//! What a parallel trainer registers about its parameters, by parameter id, for the model's
//! ops to find while it trains: the splits of fully sharded ([`crate::shard`]) and of
//! tensor-parallel ([`crate::tensor`]) parameters.

use std::collections::HashMap;
use std::sync::RwLock;

/// A process-wide map from parameter ids to `T`, empty until a trainer registers.
pub(crate) struct Registry<T>(RwLock<Option<HashMap<u64, T>>>);

impl<T: Clone> Registry<T> {
    pub(crate) const fn new() -> Self {
        Self(RwLock::new(None))
    }

    pub(crate) fn insert(&self, id: u64, value: T) {
        let mut map = self.0.write().unwrap_or_else(|e| e.into_inner());
        map.get_or_insert_with(HashMap::new).insert(id, value);
    }

    /// Whether anything is registered.
    pub(crate) fn is_active(&self) -> bool {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|m| !m.is_empty())
    }

    pub(crate) fn clear(&self) {
        if let Some(map) = self.0.write().unwrap_or_else(|e| e.into_inner()).as_mut() {
            map.clear();
        }
    }

    /// What `id` is registered with, when `keep` accepts it.
    pub(crate) fn get(&self, id: u64, keep: impl Fn(&T) -> bool) -> Option<T> {
        let map = self.0.read().unwrap_or_else(|e| e.into_inner());
        map.as_ref()?.get(&id).filter(|v| keep(v)).cloned()
    }
}
