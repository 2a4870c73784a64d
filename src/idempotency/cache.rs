//! Replays from memory: each process keeps the results of finished keys, so a retry storm
//! of keys that already committed is answered without the database.
//!
//! Why this is safe: a finished key's result never changes before its `expires_at`. A client
//! key then answers "expired"; a derived key is renewed only after it; the purge deletes a
//! row only after the retention, which is at least the replay window. So an entry is served
//! until the `expires_at` the database stored with the key, and never after: past it, the
//! request goes to the database, which decides (422 expired, or a renewed derived key).
//!
//! What a replica does not know: keys another replica finished. Those are answered from the
//! database the first time this replica sees them, and cached from then on. An in-flight key
//! is never cached (only finished results are), so the claim's wait on the unique index
//! still serialises duplicates across replicas.

use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::Fingerprint;
use crate::domain::TenantId;

/// A finished key's result, as the edge answers it.
#[derive(Debug)]
pub struct Finished<V> {
    pub fingerprint: Fingerprint,
    pub expires_at: DateTime<Utc>,
    pub value: V,
}

/// What the cache knows of a request's key.
#[derive(Debug)]
pub enum Lookup<V> {
    /// Not known here (or past its window): ask the database.
    Miss,
    /// The same request finished: its result.
    Replay(Arc<Finished<V>>),
    /// The key finished with another fingerprint.
    Reused,
}

type Entries<V> = moka::sync::Cache<(TenantId, String), Arc<Finished<V>>>;

/// Each entry leaves the cache at its `expires_at`, not only when its key is next looked
/// up: a soak of 45 minutes with a replay window of 120 s filled the cache to its capacity
/// with entries of which 94 % could never answer again (memory spent, and the entries gauge
/// overstating the useful cache). `lookup` still checks the time itself (moka expires
/// entries lazily, in its maintenance).
struct UntilItsExpiry;

impl<V> moka::Expiry<(TenantId, String), Arc<Finished<V>>> for UntilItsExpiry {
    fn expire_after_create(
        &self,
        _: &(TenantId, String),
        finished: &Arc<Finished<V>>,
        _: std::time::Instant,
    ) -> Option<std::time::Duration> {
        Some(time_left(finished))
    }

    fn expire_after_update(
        &self,
        _: &(TenantId, String),
        finished: &Arc<Finished<V>>,
        _: std::time::Instant,
        _: Option<std::time::Duration>,
    ) -> Option<std::time::Duration> {
        Some(time_left(finished))
    }
}

fn time_left<V>(finished: &Finished<V>) -> std::time::Duration {
    (finished.expires_at - Utc::now()).to_std().unwrap_or_default()
}

/// A bounded map from (tenant, key) to a finished result; `capacity` 0 turns it off.
pub struct ReplayCache<V> {
    entries: Option<Entries<V>>,
}

impl<V: Send + Sync + 'static> ReplayCache<V> {
    /// Least recently used entries go first. Not moka's default (TinyLFU), whose admission
    /// turns a new entry away once the cache is full unless its key was seen more often than
    /// the entry it would evict: every key here is seen once when it finishes, so a full
    /// cache stopped taking the newest keys, the very ones a retry storm replays (measured
    /// in `make bench`: 91 % of a storm's replays from memory with key affinity, 9 % missed).
    pub fn new(capacity: u64) -> Self {
        Self {
            entries: (capacity > 0).then(|| {
                moka::sync::Cache::builder()
                    .max_capacity(capacity)
                    .eviction_policy(moka::policy::EvictionPolicy::lru())
                    .expire_after(UntilItsExpiry)
                    .build()
            }),
        }
    }

    pub fn lookup(&self, tenant: TenantId, key: &str, fingerprint: &Fingerprint) -> Lookup<V> {
        let Some(entries) = &self.entries else {
            return Lookup::Miss;
        };
        let id = (tenant, key.to_owned());
        match entries.get(&id) {
            Some(finished) if finished.expires_at <= Utc::now() => {
                entries.invalidate(&id);
                Lookup::Miss
            }
            Some(finished) if finished.fingerprint == *fingerprint => Lookup::Replay(finished),
            Some(_) => Lookup::Reused,
            None => Lookup::Miss,
        }
    }

    pub fn insert(&self, tenant: TenantId, key: &str, finished: Finished<V>) {
        if let Some(entries) = &self.entries {
            if finished.expires_at > Utc::now() {
                entries.insert((tenant, key.to_owned()), Arc::new(finished));
            }
        }
    }

    /// Entries held now (approximate: moka counts lazily).
    pub fn len(&self) -> u64 {
        self.entries.as_ref().map_or(0, |e| e.entry_count())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished(fp: u8, expires_in_ms: i64) -> Finished<&'static str> {
        Finished {
            fingerprint: [fp; 32],
            expires_at: Utc::now() + chrono::Duration::milliseconds(expires_in_ms),
            value: "answer",
        }
    }

    #[test]
    fn a_finished_key_replays_only_its_own_fingerprint_and_only_for_its_tenant() {
        let cache = ReplayCache::new(10);
        let tenant = TenantId::new_random();
        cache.insert(tenant, "k", finished(1, 60_000));

        assert!(matches!(cache.lookup(tenant, "k", &[1; 32]), Lookup::Replay(f) if f.value == "answer"));
        assert!(matches!(cache.lookup(tenant, "k", &[2; 32]), Lookup::Reused));
        assert!(matches!(
            cache.lookup(TenantId::new_random(), "k", &[1; 32]),
            Lookup::Miss
        ));
        assert!(matches!(cache.lookup(tenant, "other", &[1; 32]), Lookup::Miss));
    }

    #[test]
    fn an_entry_is_never_served_at_or_after_its_expiry() {
        let cache = ReplayCache::new(10);
        let tenant = TenantId::new_random();
        cache.insert(tenant, "past", finished(1, -1));
        cache.insert(tenant, "soon", finished(1, 50));
        assert!(matches!(cache.lookup(tenant, "past", &[1; 32]), Lookup::Miss));
        assert!(matches!(cache.lookup(tenant, "soon", &[1; 32]), Lookup::Replay(_)));
        std::thread::sleep(std::time::Duration::from_millis(60));
        assert!(matches!(cache.lookup(tenant, "soon", &[1; 32]), Lookup::Miss));
    }

    #[test]
    fn an_entry_leaves_the_cache_at_its_expiry_without_being_looked_up() {
        let cache = ReplayCache::new(100);
        let tenant = TenantId::new_random();
        for i in 0..10 {
            cache.insert(tenant, &format!("short{i}"), finished(1, 50));
        }
        cache.insert(tenant, "long", finished(1, 60_000));
        // moka's timer wheel counts in steps of about a second.
        std::thread::sleep(std::time::Duration::from_millis(2_200));
        if let Some(entries) = &cache.entries {
            entries.run_pending_tasks();
        }
        assert_eq!(cache.len(), 1, "only the entry inside its window is held");
        assert!(matches!(cache.lookup(tenant, "long", &[1; 32]), Lookup::Replay(_)));
    }

    #[test]
    fn a_full_cache_keeps_the_newest_keys() {
        let cache = ReplayCache::new(100);
        let tenant = TenantId::new_random();
        for i in 0..1_000 {
            cache.insert(tenant, &format!("k{i}"), finished(1, 60_000));
        }
        if let Some(entries) = &cache.entries {
            entries.run_pending_tasks();
        }
        assert!(cache.len() <= 100, "bounded: {}", cache.len());
        for i in 990..1_000 {
            assert!(
                matches!(cache.lookup(tenant, &format!("k{i}"), &[1; 32]), Lookup::Replay(_)),
                "k{i}, among the last inserted, is served"
            );
        }
        assert!(
            matches!(cache.lookup(tenant, "k0", &[1; 32]), Lookup::Miss),
            "the oldest went first"
        );
    }

    #[test]
    fn capacity_zero_turns_the_cache_off() {
        let cache = ReplayCache::new(0);
        let tenant = TenantId::new_random();
        cache.insert(tenant, "k", finished(1, 60_000));
        assert!(matches!(cache.lookup(tenant, "k", &[1; 32]), Lookup::Miss));
        assert!(cache.is_empty());
    }
}
