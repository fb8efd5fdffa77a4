//! `Slots<T>`: values stored at stable `u32` indices, with vacant slots reused (a free list threaded
//! through the vacant entries, as the `slab` crate does).

use std::ops::{Index, IndexMut};

/// One slot: a value, or the index of the next vacant slot.
#[derive(Debug, Clone)]
enum Entry<T> {
    Occupied(T),
    Vacant { next: u32 },
}

/// Values at stable indices. Indexing a vacant slot is a bug in the pool and panics with the index.
#[derive(Debug, Clone)]
pub(crate) struct Slots<T> {
    entries: Vec<Entry<T>>,
    /// The first vacant slot, or `NONE`.
    vacant: u32,
    len: usize,
}

const NONE: u32 = u32::MAX;

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Slots { entries: Vec::new(), vacant: NONE, len: 0 }
    }
}

impl<T> Slots<T> {
    /// Stores `value` in a vacant slot (or a new one) and returns its index.
    pub(crate) fn insert(&mut self, value: T) -> u32 {
        self.len += 1;
        if self.vacant == NONE {
            self.entries.push(Entry::Occupied(value));
            return u32::try_from(self.entries.len() - 1).expect("fewer than 2^32 slots");
        }
        let i = self.vacant;
        match std::mem::replace(&mut self.entries[i as usize], Entry::Occupied(value)) {
            Entry::Vacant { next } => self.vacant = next,
            Entry::Occupied(_) => unreachable!("the vacant list points at an occupied slot"),
        }
        i
    }

    /// Takes the value out of slot `i`, which becomes vacant. `None` if it was vacant already.
    pub(crate) fn remove(&mut self, i: u32) -> Option<T> {
        let entry = self.entries.get_mut(i as usize)?;
        if matches!(entry, Entry::Vacant { .. }) {
            return None;
        }
        let Entry::Occupied(value) = std::mem::replace(entry, Entry::Vacant { next: self.vacant }) else {
            unreachable!("checked above")
        };
        self.vacant = i;
        self.len -= 1;
        Some(value)
    }

    pub(crate) fn get(&self, i: u32) -> Option<&T> {
        match self.entries.get(i as usize) {
            Some(Entry::Occupied(v)) => Some(v),
            _ => None,
        }
    }

    pub(crate) fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        match self.entries.get_mut(i as usize) {
            Some(Entry::Occupied(v)) => Some(v),
            _ => None,
        }
    }

    /// The number of occupied slots.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Every occupied slot with its index, in index order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.entries.iter().enumerate().filter_map(|(i, e)| match e {
            Entry::Occupied(v) => Some((i as u32, v)),
            Entry::Vacant { .. } => None,
        })
    }

    /// The indices of the occupied slots (a snapshot, so the slots may change while it is used).
    pub(crate) fn indices(&self) -> Vec<u32> {
        self.iter().map(|(i, _)| i).collect()
    }
}

impl<T> Index<u32> for Slots<T> {
    type Output = T;

    #[track_caller]
    fn index(&self, i: u32) -> &T {
        match self.get(i) {
            Some(v) => v,
            None => panic!("pool bookkeeping: slot {i} is vacant"),
        }
    }
}

impl<T> IndexMut<u32> for Slots<T> {
    #[track_caller]
    fn index_mut(&mut self, i: u32) -> &mut T {
        match self.get_mut(i) {
            Some(v) => v,
            None => panic!("pool bookkeeping: slot {i} is vacant"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Slots;

    #[test]
    fn vacant_slots_are_reused_last_freed_first() {
        let mut s = Slots::default();
        let (a, b, c) = (s.insert('a'), s.insert('b'), s.insert('c'));
        assert_eq!((a, b, c, s.len()), (0, 1, 2, 3));
        assert_eq!(s.remove(b), Some('b'));
        assert_eq!(s.remove(b), None);
        assert_eq!(s.remove(a), Some('a'));
        assert_eq!(s.len(), 1);
        assert_eq!(s.insert('d'), a);
        assert_eq!(s.insert('e'), b);
        assert_eq!(s.insert('f'), 3);
        assert_eq!(s.iter().map(|(i, v)| (i, *v)).collect::<Vec<_>>(), [(0, 'd'), (1, 'e'), (2, 'c'), (3, 'f')]);
        assert_eq!(s.get(7), None);
        s[c] = 'g';
        assert_eq!(s[c], 'g');
    }

    #[test]
    #[should_panic(expected = "slot 1 is vacant")]
    fn indexing_a_vacant_slot_panics_with_its_index() {
        let mut s = Slots::default();
        s.insert(1);
        let i = s.insert(2);
        s.remove(i);
        let _ = s[i];
    }
}
