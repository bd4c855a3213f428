//! Per-sandbox host uid/gid ranges of the `function` backend.
//!
//! Every jail (sandbox or pooled) gets a slot `s` of its own; its uids/gids `0..65536`
//! inside map to host ids `base + s × 65536 ..` where `base` is
//! [`super::function::FunctionConfig::uid_base`] (100000 by default). The slot is the
//! lowest one no live jail holds. A jail records its host base in `state.json`
//! (`uid_base`); after a node restart the slots are rebuilt from those files when the
//! jails are re-adopted ([`UidSlots::reserve`]).
//!
//! Security: distinct ranges keep sandboxes apart where the kernel compares host uids:
//! file ownership, signals and ptrace between processes, and the per-user counts and
//! limits (`fs.inotify.max_user_instances`, `user.max_*`, RLIMIT_NPROC). Each sandbox's
//! user namespace is owned by its own base uid (see `sandlot-guest init`), so what one
//! sandbox creates is charged to that uid only: it can exhaust its own share, never host
//! root's or another sandbox's.
//!
//! Slots are capped so that the highest mapped id stays below `u32::MAX − 65536` (ids
//! near `u32::MAX` are special: `(uid_t)-1` means "unchanged" to setresuid(2), 65534 and
//! the overflow ids are the kernel's "nobody"); when all are taken, a create fails with
//! `ResourceExhausted`.
use crate::node::{NodeError, NodeResult};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Number of uids/gids mapped into a sandbox (`0..65536` inside → `uid_base..` outside).
pub const UID_COUNT: u32 = 65_536;

/// Ids per slot (`0..65536` inside a sandbox): one sandbox's [`UID_COUNT`].
pub const SLOT_SIZE: u32 = UID_COUNT;

/// Highest host id + 1 that a slot may reach.
const LIMIT: u64 = u32::MAX as u64 - SLOT_SIZE as u64;

/// The slot table of one function backend (shared with its warm pool).
#[derive(Debug)]
pub struct UidSlots {
    base: u32,
    slots: u32,
    /// Slot → number of live leases (more than one only for jails of an older version
    /// that all used the shared base, re-adopted after an upgrade).
    used: Mutex<BTreeMap<u32, usize>>,
}

/// A held slot range; released on drop.
#[derive(Debug)]
pub struct UidLease {
    owner: Arc<UidSlots>,
    /// Host uid/gid of root inside the jail.
    base: u32,
    /// Slots held (one, or two for a re-adopted base that is not slot-aligned).
    slots: Vec<u32>,
}

impl UidLease {
    /// Host uid/gid that uid/gid 0 inside the jail maps to.
    pub fn base(&self) -> u32 {
        self.base
    }
}

impl Drop for UidLease {
    fn drop(&mut self) {
        let mut used = self.owner.used.lock().unwrap_or_else(|e| e.into_inner());
        for s in &self.slots {
            if let Some(n) = used.get_mut(s) {
                *n -= 1;
                if *n == 0 {
                    used.remove(s);
                }
            }
        }
    }
}

impl UidSlots {
    /// Slots above host uid `base`: as many whole ranges of [`SLOT_SIZE`] ids as fit below
    /// `u32::MAX − 65536` (65533 for the default base 100000; 0 when `base` is too high).
    pub fn new(base: u32) -> Arc<UidSlots> {
        let slots = (LIMIT.saturating_sub(u64::from(base)) / u64::from(SLOT_SIZE)) as u32;
        Arc::new(UidSlots {
            base,
            slots,
            used: Mutex::new(BTreeMap::new()),
        })
    }

    /// Number of slots.
    pub fn capacity(&self) -> u32 {
        self.slots
    }

    /// Slots currently held.
    pub fn in_use(&self) -> usize {
        self.used.lock().unwrap().len()
    }

    /// The lowest free slot, held until the lease is dropped.
    ///
    /// # Errors
    /// `ResourceExhausted` when every slot is held.
    pub fn allocate(self: &Arc<Self>) -> NodeResult<UidLease> {
        let mut used = self.used.lock().unwrap();
        // Lowest gap in the sorted keys.
        let mut slot = 0u32;
        for &s in used.keys() {
            if s != slot {
                break;
            }
            slot += 1;
        }
        if slot >= self.slots {
            return Err(NodeError::ResourceExhausted(format!(
                "no free host uid range for a function sandbox: all {} ranges of {SLOT_SIZE} \
                 ids above uid {} are in use",
                self.slots, self.base
            )));
        }
        used.insert(slot, 1);
        Ok(UidLease {
            owner: self.clone(),
            base: self.base + slot * SLOT_SIZE,
            slots: vec![slot],
        })
    }

    /// The highest free slot, held until the lease is dropped: for ids the node holds for
    /// its whole life (the QEMUs' shared group, see [`super::qemu::QemuUids`]), away from
    /// the low slots that sandboxes take first and re-adopted ones hold.
    ///
    /// # Errors
    /// `ResourceExhausted` when every slot is held.
    pub fn allocate_highest(self: &Arc<Self>) -> NodeResult<UidLease> {
        let mut used = self.used.lock().unwrap();
        let slot = (0..self.slots)
            .rev()
            .find(|s| !used.contains_key(s))
            .ok_or_else(|| {
                NodeError::ResourceExhausted(format!(
                    "no free host uid range: all {} ranges above uid {} are in use",
                    self.slots, self.base
                ))
            })?;
        used.insert(slot, 1);
        Ok(UidLease {
            owner: self.clone(),
            base: self.base + slot * SLOT_SIZE,
            slots: vec![slot],
        })
    }

    /// Hold whatever slots the range `host_base .. host_base + 65536` of a re-adopted jail
    /// overlaps (one when it is slot-aligned; a jail of an older version holds the shared
    /// base, i.e. slot 0, which several may share), so that no new jail gets an
    /// overlapping range. A range outside the table (the node's base changed) holds
    /// nothing.
    pub fn reserve(self: &Arc<Self>, host_base: u32) -> UidLease {
        let lo = u64::from(host_base);
        let hi = lo + u64::from(SLOT_SIZE); // exclusive
        let first = u64::from(self.base);
        let mut slots = Vec::new();
        for s in [lo, hi - 1] {
            if s >= first {
                let slot = (s - first) / u64::from(SLOT_SIZE);
                if slot < u64::from(self.slots) && !slots.contains(&(slot as u32)) {
                    slots.push(slot as u32);
                }
            }
        }
        let mut used = self.used.lock().unwrap();
        for s in &slots {
            *used.entry(*s).or_insert(0) += 1;
        }
        UidLease {
            owner: self.clone(),
            base: host_base,
            slots,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_free_slot_and_release() {
        let t = UidSlots::new(100_000);
        assert_eq!(t.capacity(), 65533);
        let a = t.allocate().unwrap();
        let b = t.allocate().unwrap();
        let c = t.allocate().unwrap();
        assert_eq!((a.base(), b.base(), c.base()), (100_000, 165_536, 231_072));
        drop(b);
        assert_eq!(t.in_use(), 2);
        let b2 = t.allocate().unwrap();
        assert_eq!(b2.base(), 165_536, "the freed slot is reused first");
        drop((a, b2, c));
        assert_eq!(t.in_use(), 0);
    }

    #[test]
    fn capacity_keeps_the_highest_id_below_u32_max_minus_a_range() {
        for base in [0u32, 100_000, 1 << 31, u32::MAX - 3 * SLOT_SIZE] {
            let t = UidSlots::new(base);
            let top = u64::from(base) + u64::from(t.capacity()) * u64::from(SLOT_SIZE);
            assert!(top <= LIMIT, "base {base}: top {top}");
            assert!(
                top + u64::from(SLOT_SIZE) > LIMIT,
                "base {base}: a slot left unused"
            );
        }
        let full = UidSlots::new(u32::MAX - SLOT_SIZE);
        assert_eq!(full.capacity(), 0);
        assert!(matches!(
            full.allocate(),
            Err(NodeError::ResourceExhausted(_))
        ));
    }

    #[test]
    fn highest_slot_is_taken_from_the_top() {
        let t = UidSlots::new(u32::MAX - 4 * SLOT_SIZE); // room for 3 slots
        let top = t.allocate_highest().unwrap();
        assert_eq!(top.slots, vec![2]);
        let low = t.allocate().unwrap();
        assert_eq!(low.slots, vec![0]);
        let next = t.allocate_highest().unwrap();
        assert_eq!(next.slots, vec![1]);
        assert!(matches!(
            t.allocate_highest(),
            Err(NodeError::ResourceExhausted(_))
        ));
        drop((top, low, next));
    }

    #[test]
    fn exhaustion_is_resource_exhausted() {
        let t = UidSlots::new(u32::MAX - 3 * SLOT_SIZE); // room for 2 slots
        assert_eq!(t.capacity(), 2);
        let _a = t.allocate().unwrap();
        let _b = t.allocate().unwrap();
        assert!(matches!(t.allocate(), Err(NodeError::ResourceExhausted(_))));
    }

    #[test]
    fn reserved_ranges_are_skipped_and_shared_old_bases_counted() {
        let t = UidSlots::new(100_000);
        // Two jails of an older version, both on the shared base (slot 0), and one on slot 2.
        let old1 = t.reserve(100_000);
        let old2 = t.reserve(100_000);
        let s2 = t.reserve(100_000 + 2 * SLOT_SIZE);
        assert_eq!(t.allocate().unwrap().base(), 165_536);
        drop(old1);
        let n = t.allocate().unwrap();
        assert_eq!(
            n.base(),
            165_536,
            "slot 0 still held by the second old jail"
        );
        drop(old2);
        assert_eq!(t.allocate().unwrap().base(), 100_000);
        // An unaligned range holds both slots it overlaps.
        let odd = t.reserve(100_000 + 3 * SLOT_SIZE + 10);
        assert_eq!(odd.slots, vec![3, 4]);
        drop((n, s2));
        // Outside the table: holds nothing.
        let out = t.reserve(5);
        assert!(out.slots.is_empty());
        assert_eq!(out.base(), 5);
    }
}
