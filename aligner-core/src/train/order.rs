//! The order examples are visited in, and the mini-batches of an update: written once, used by
//! the shared trainer and by PPO's runner.

use std::ops::Range;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// Examples epoch after epoch, each epoch a permutation seeded by `(seed, epoch)` (file order
/// when not shuffled), so any position of a run can be recomputed when it resumes.
pub struct EpochOrder {
    len: usize,
    shuffle: bool,
    seed: u64,
    epoch_seed: fn(u64, usize) -> u64,
    /// The order of the epoch last used: an epoch is shuffled once, not once per batch.
    cached: Option<(usize, Vec<usize>)>,
}

impl EpochOrder {
    /// `len` examples, shuffled per epoch with the trainer's seeding.
    pub fn new(len: usize, shuffle: bool, seed: u64) -> Self {
        Self {
            len,
            shuffle,
            seed,
            epoch_seed: |seed, epoch| seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9),
            cached: None,
        }
    }

    /// The same order with another way of deriving an epoch's shuffle seed from the run's seed
    /// (PPO draws its prompts with `seed + epoch`).
    pub fn with_epoch_seed(mut self, epoch_seed: fn(u64, usize) -> u64) -> Self {
        self.epoch_seed = epoch_seed;
        self.cached = None;
        self
    }

    /// Examples in one epoch.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The example order of `epoch`.
    pub fn epoch(&mut self, epoch: usize) -> &[usize] {
        if self.cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut order: Vec<usize> = (0..self.len).collect();
            if self.shuffle {
                order.shuffle(&mut ChaCha8Rng::seed_from_u64((self.epoch_seed)(
                    self.seed, epoch,
                )));
            }
            self.cached = Some((epoch, order));
        }
        &self.cached.as_ref().expect("set above").1
    }

    /// Batches of `size` in one epoch (the last may be short).
    pub fn batches_per_epoch(&self, size: usize) -> usize {
        self.len.div_ceil(size.max(1))
    }

    /// Example indices of batch `k`, counting across epochs; an epoch's last batch may be short.
    pub fn batch(&mut self, k: usize, size: usize) -> Vec<usize> {
        let size = size.max(1);
        let per_epoch = self.batches_per_epoch(size).max(1);
        let (epoch, index) = (k / per_epoch, k % per_epoch);
        let order = self.epoch(epoch);
        order[(index * size).min(order.len())..((index + 1) * size).min(order.len())].to_vec()
    }

    /// Items `start..start + count` of the endless run of epochs (a stretch may span two).
    pub fn items(&mut self, start: usize, count: usize) -> Vec<usize> {
        if self.len == 0 {
            return Vec::new();
        }
        let len = self.len;
        (start..start + count)
            .map(|flat| self.epoch(flat / len)[flat % len])
            .collect()
    }
}

/// The index ranges of mini-batches of `size` over `n` items, in order, `epochs` passes in a row
/// (at least one): the update loops of PPO's actor and critic.
pub fn mini_batches(n: usize, size: usize, epochs: usize) -> impl Iterator<Item = Range<usize>> {
    let size = size.max(1);
    (0..epochs.max(1)).flat_map(move |_| {
        (0..n)
            .step_by(size)
            .map(move |start| start..(start + size).min(n))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_cover_each_epoch_once_and_repeat_per_seed() {
        let mut order = EpochOrder::new(10, true, 7);
        let mut seen: Vec<usize> = (0..3).flat_map(|k| order.batch(k, 4)).collect();
        assert_eq!(order.batch(2, 4).len(), 2, "the epoch's last batch is short");
        seen.sort();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        // Epoch 1 starts at batch 3 with another permutation; the same seed gives the same one.
        let second = order.batch(3, 4);
        assert_eq!(EpochOrder::new(10, true, 7).batch(3, 4), second);
        assert_ne!(order.epoch(0).to_vec(), order.epoch(1).to_vec());
        assert_eq!(EpochOrder::new(5, false, 7).batch(1, 2), vec![2, 3]);
    }

    #[test]
    fn items_run_on_across_epochs() {
        let mut order = EpochOrder::new(3, false, 0);
        assert_eq!(order.items(2, 4), vec![2, 0, 1, 2]);
        let mut shuffled = EpochOrder::new(4, true, 3).with_epoch_seed(|s, e| s.wrapping_add(e as u64));
        let first: Vec<usize> = shuffled.epoch(1).to_vec();
        assert_eq!(shuffled.items(4, 4), first);
    }

    #[test]
    fn mini_batches_repeat_per_epoch() {
        let ranges: Vec<_> = mini_batches(5, 2, 2).collect();
        assert_eq!(ranges, vec![0..2, 2..4, 4..5, 0..2, 2..4, 4..5]);
        assert_eq!(mini_batches(3, 0, 0).count(), 3);
    }
}
