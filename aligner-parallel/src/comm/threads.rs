//! Ranks that are threads of one process: every collective is an all-gather through slots
//! the threads share. For checking collective ops (tensor parallel, the distillation losses
//! over a split vocabulary) against one piece without MPI; not a transport for training.

use std::sync::{Arc, Barrier, Mutex, MutexGuard};

use super::{
    CommError, CommResult, Communicator, ReduceOp, Traffic, WorkQueue, check_blocks, f32_bytes, f32s,
};

/// One rank of a group of threads ([`Threads::group`]).
pub struct Threads {
    rank: usize,
    size: usize,
    shared: Arc<(Barrier, Mutex<Vec<Vec<u8>>>)>,
}

impl Threads {
    /// The `size` ranks of a new group, one for each thread that will run a rank: rank `r` is
    /// the `r`-th. Every rank's thread must call the same collectives in the same order.
    pub fn group(size: usize) -> Vec<Arc<dyn Communicator>> {
        let shared = Arc::new((Barrier::new(size), Mutex::new(vec![Vec::new(); size])));
        (0..size)
            .map(|rank| {
                Arc::new(Threads {
                    rank,
                    size,
                    shared: shared.clone(),
                }) as Arc<dyn Communicator>
            })
            .collect()
    }

    /// Runs `f(rank, group)` for each of the `size` ranks of a new group, each on a thread of
    /// its own, and returns when every rank has (a rank's panic ends the call with it).
    pub fn run(size: usize, f: impl Fn(usize, Arc<dyn Communicator>) + Sync) {
        let ranks = Self::group(size);
        std::thread::scope(|scope| {
            for (rank, comm) in ranks.into_iter().enumerate() {
                let f = &f;
                scope.spawn(move || f(rank, comm));
            }
        });
    }

    fn slots(&self) -> MutexGuard<'_, Vec<Vec<u8>>> {
        // A rank that panicked leaves the bytes as they were; the others still read them.
        self.shared
            .1
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn combine<T: Copy>(
        parts: &[Vec<T>],
        op: ReduceOp,
        i: usize,
        add: fn(T, T) -> T,
        max: fn(T, T) -> T,
    ) -> T {
        let values = parts.iter().map(|p| p[i]);
        match op {
            ReduceOp::Sum | ReduceOp::Mean => values.reduce(add),
            ReduceOp::Max => values.reduce(max),
        }
        .unwrap_or(parts[0][i])
    }
}

impl Communicator for Threads {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> CommResult<()> {
        let parts: Vec<Vec<f32>> = self
            .all_gather(&f32_bytes(buf))?
            .iter()
            .map(|p| f32s(p))
            .collect();
        for (i, v) in buf.iter_mut().enumerate() {
            *v = Self::combine(&parts, op, i, |a, b| a + b, f32::max);
            if op == ReduceOp::Mean {
                *v /= self.size as f32;
            }
        }
        Ok(())
    }
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> CommResult<()> {
        let bytes: Vec<u8> = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let parts: Vec<Vec<f64>> = self
            .all_gather(&bytes)?
            .iter()
            .map(|p| {
                p.chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap_or_default()))
                    .collect()
            })
            .collect();
        for (i, v) in buf.iter_mut().enumerate() {
            *v = Self::combine(&parts, op, i, |a, b| a + b, f64::max);
            if op == ReduceOp::Mean {
                *v /= self.size as f64;
            }
        }
        Ok(())
    }
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32]) -> CommResult<()> {
        check_blocks(send.len(), recv.len(), self.size)?;
        let mut sum = send.to_vec();
        self.all_reduce(&mut sum, ReduceOp::Sum)?;
        let own = self.rank * recv.len();
        recv.copy_from_slice(&sum[own..own + recv.len()]);
        Ok(())
    }
    fn broadcast(&self, bytes: &mut Vec<u8>, root: usize) -> CommResult<()> {
        let mut all = self.all_gather(bytes)?;
        if root >= all.len() {
            return Err(CommError::Failed(format!(
                "broadcast from rank {root} of {}",
                self.size
            )));
        }
        *bytes = all.swap_remove(root);
        Ok(())
    }
    fn all_gather(&self, bytes: &[u8]) -> CommResult<Vec<Vec<u8>>> {
        let barrier = &self.shared.0;
        self.slots()[self.rank] = bytes.to_vec();
        barrier.wait();
        let all = self.slots().clone();
        // Nobody writes the next collective's bytes before every rank has read these.
        barrier.wait();
        Ok(all)
    }
    fn barrier(&self) -> CommResult<()> {
        self.shared.0.wait();
        Ok(())
    }
    fn work_queue(&self, _: usize, _: usize) -> CommResult<Box<dyn WorkQueue + '_>> {
        Err(CommError::Failed(
            "a group of threads has no shared work queue".into(),
        ))
    }
    fn traffic(&self) -> Traffic {
        Traffic::default()
    }
    fn split(&self, _: usize, _: usize) -> CommResult<Arc<dyn Communicator>> {
        Err(CommError::Failed(
            "a group of threads does not split into sub-groups".into(),
        ))
    }
}
