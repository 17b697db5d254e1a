//! The MPI world: the processes `mpirun` / `srun` started, on one node or many.
//!
//! MPI is initialised with `MPI_THREAD_SERIALIZED` and every call goes through one mutex, so
//! rank 0's work-queue dispatcher thread and its main thread never call MPI at once.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::point_to_point::MatchedReceiveVec;
use mpi::topology::Color;
use mpi::topology::Communicator as _;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::queue::{LocalQueue, WorkQueue};
use super::{CommError, CommResult, Communicator, ReduceOp, Traffic, TrafficMeter};

struct Handles {
    /// `None` once finalised.
    universe: Option<Universe>,
    world: SimpleCommunicator,
    /// Sub-communicators split off the world ([`Communicator::split`]), freed before MPI is
    /// finalised.
    subs: Vec<SimpleCommunicator>,
}

// SAFETY: MPI handles are plain integers or pointers owned by the MPI library; MPI is
// initialised at MPI_THREAD_SERIALIZED and every use goes through the mutex around `Handles`,
// so no two threads call MPI at once.
unsafe impl Send for Handles {}

struct Inner {
    /// Shared by the world and every communicator split off it: one lock for all MPI calls.
    handles: Arc<Mutex<Handles>>,
    /// Which communicator this is: the world (`None`) or `subs[i]`.
    sub: Option<usize>,
    rank: usize,
    size: usize,
    traffic: TrafficMeter,
    queues: AtomicU64,
}

impl Inner {
    fn lock(&self) -> CommResult<MutexGuard<'_, Handles>> {
        let guard = self
            .handles
            .lock()
            .map_err(|_| CommError::Failed("MPI state poisoned by a panic".into()))?;
        if guard.universe.is_none() {
            return Err(CommError::Failed("MPI is already finalised".into()));
        }
        Ok(guard)
    }

    /// This communicator's MPI handle.
    fn comm<'a>(&self, handles: &'a Handles) -> &'a SimpleCommunicator {
        match self.sub {
            None => &handles.world,
            Some(i) => &handles.subs[i],
        }
    }
}

static STARTED: OnceLock<Arc<Inner>> = OnceLock::new();

/// How long [`Communicator::all_reduce_polled`] leaves the lock between looks.
const POLL: Duration = Duration::from_micros(50);

/// The MPI world of this process.
pub(crate) struct Mpi {
    inner: Arc<Inner>,
}

impl Mpi {
    pub(crate) fn init() -> CommResult<Self> {
        if let Some(inner) = STARTED.get() {
            return Ok(Self { inner: inner.clone() });
        }
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| CommError::Failed("MPI was initialised elsewhere".into()))?;
        if threading < Threading::Serialized {
            return Err(CommError::Failed(format!(
                "this MPI library gives thread level {threading:?}; aligner needs Serialized"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let inner = Arc::new(Inner {
            handles: Arc::new(Mutex::new(Handles {
                universe: Some(universe),
                world,
                subs: Vec::new(),
            })),
            sub: None,
            rank,
            size,
            traffic: TrafficMeter::default(),
            queues: AtomicU64::new(0),
        });
        let _ = STARTED.set(inner.clone());
        Ok(Self { inner })
    }
}

/// Finalises MPI (after a barrier, so no rank leaves while another still needs it).
pub(crate) fn finalize() {
    if let Some(inner) = STARTED.get()
        && let Ok(mut handles) = inner.handles.lock()
    {
        if handles.universe.is_some() {
            handles.world.barrier();
        }
        handles.subs.clear();
        drop(handles.universe.take());
    }
}

/// `MPI_Abort` on the world: mpirun ends every rank.
pub(crate) fn abort(code: i32) {
    if let Some(inner) = STARTED.get() {
        // The lock may be held by a rank stuck in a collective; abort does not need it.
        let handles = match inner.handles.try_lock() {
            Ok(handles) => handles,
            Err(_) => std::process::exit(code),
        };
        if handles.universe.is_some() {
            handles.world.abort(code);
        }
    }
}

fn reduce<T>(world: &SimpleCommunicator, buf: &mut [T], op: ReduceOp)
where
    T: Copy + Equivalence,
{
    let send = buf.to_vec();
    match op {
        ReduceOp::Max => world.all_reduce_into(&send[..], buf, SystemOperation::max()),
        ReduceOp::Sum | ReduceOp::Mean => world.all_reduce_into(&send[..], buf, SystemOperation::sum()),
    }
}

impl Communicator for Mpi {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world_size(&self) -> usize {
        self.inner.size
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> CommResult<()> {
        let started = Instant::now();
        reduce(self.inner.comm(&*self.inner.lock()?), buf, op);
        if op == ReduceOp::Mean {
            let inv = 1.0 / self.inner.size as f32;
            buf.iter_mut().for_each(|x| *x *= inv);
        }
        self.inner
            .traffic
            .record(std::mem::size_of_val(buf), started.elapsed());
        Ok(())
    }

    fn all_reduce_polled(&self, buf: &mut [f32]) -> CommResult<()> {
        let started = Instant::now();
        let send = buf.to_vec();
        let mut failed = None;
        mpi::request::scope(|scope| {
            let mut request = {
                let handles = match self.inner.lock() {
                    Ok(handles) => handles,
                    Err(e) => {
                        failed = Some(e);
                        return;
                    }
                };
                self.inner.comm(&handles).immediate_all_reduce_into(
                    scope,
                    &send[..],
                    &mut *buf,
                    SystemOperation::sum(),
                )
            };
            loop {
                match self.inner.handles.lock() {
                    Ok(_held) => match request.test() {
                        Ok(_) => return,
                        Err(pending) => request = pending,
                    },
                    // A poisoned lock: MPI itself is still sound, so wait it out unlocked.
                    Err(_) => {
                        request.wait_without_status();
                        return;
                    }
                }
                std::thread::sleep(POLL);
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        self.inner
            .traffic
            .record(std::mem::size_of_val(buf), started.elapsed());
        Ok(())
    }

    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> CommResult<()> {
        reduce(self.inner.comm(&*self.inner.lock()?), buf, op);
        if op == ReduceOp::Mean {
            let n = self.inner.size as f64;
            buf.iter_mut().for_each(|x| *x /= n);
        }
        Ok(())
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32]) -> CommResult<()> {
        super::check_blocks(send.len(), recv.len(), self.inner.size)?;
        let started = Instant::now();
        let handles = self.inner.lock()?;
        self.inner
            .comm(&handles)
            .reduce_scatter_block_into(send, recv, SystemOperation::sum());
        drop(handles);
        self.inner
            .traffic
            .record(std::mem::size_of_val(send), started.elapsed());
        Ok(())
    }

    fn broadcast(&self, bytes: &mut Vec<u8>, root: usize) -> CommResult<()> {
        let handles = self.inner.lock()?;
        let root = self.inner.comm(&handles).process_at_rank(root as i32);
        let mut len = bytes.len() as u64;
        root.broadcast_into(&mut len);
        bytes.resize(len as usize, 0);
        // MPI counts are 32-bit: a larger buffer goes in pieces.
        for piece in bytes.chunks_mut(1 << 30) {
            root.broadcast_into(piece);
        }
        Ok(())
    }

    fn all_gather(&self, bytes: &[u8]) -> CommResult<Vec<Vec<u8>>> {
        let handles = self.inner.lock()?;
        let comm = self.inner.comm(&handles);
        let lengths = part_lengths(comm, bytes, self.inner.size);
        let mut out: Vec<Vec<u8>> = lengths.iter().map(|&n| Vec::with_capacity(n)).collect();
        for round in Rounds::new(&lengths) {
            let mut all = vec![0u8; round.total()];
            let displs = round.displs();
            {
                let mut partition = PartitionMut::new(&mut all[..], round.counts(), &displs[..]);
                comm.all_gather_varcount_into(
                    not_in_place(&bytes[round.mine(self.inner.rank)]),
                    &mut partition,
                );
            }
            round.append(&all, &mut out);
        }
        Ok(out)
    }

    fn gather(&self, bytes: &[u8], root: usize) -> CommResult<Option<Vec<Vec<u8>>>> {
        let handles = self.inner.lock()?;
        let comm = self.inner.comm(&handles);
        let lengths = part_lengths(comm, bytes, self.inner.size);
        let at_root = self.inner.rank == root;
        let mut out: Vec<Vec<u8>> = match at_root {
            true => lengths.iter().map(|&n| Vec::with_capacity(n)).collect(),
            false => Vec::new(),
        };
        let process = comm.process_at_rank(root as i32);
        for round in Rounds::new(&lengths) {
            let mine = not_in_place(&bytes[round.mine(self.inner.rank)]);
            if !at_root {
                process.gather_varcount_into(mine);
                continue;
            }
            let mut all = vec![0u8; round.total()];
            let displs = round.displs();
            {
                let mut partition = PartitionMut::new(&mut all[..], round.counts(), &displs[..]);
                process.gather_varcount_into_root(mine, &mut partition);
            }
            round.append(&all, &mut out);
        }
        Ok(at_root.then_some(out))
    }

    fn barrier(&self) -> CommResult<()> {
        self.inner.comm(&*self.inner.lock()?).barrier();
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> CommResult<Arc<dyn Communicator>> {
        let mut handles = self.inner.lock()?;
        let sub = self
            .inner
            .comm(&handles)
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .ok_or_else(|| CommError::Failed("MPI_Comm_split gave no communicator".into()))?;
        let (rank, size) = (sub.rank() as usize, sub.size() as usize);
        handles.subs.push(sub);
        let index = handles.subs.len() - 1;
        drop(handles);
        Ok(Arc::new(Mpi {
            inner: Arc::new(Inner {
                handles: self.inner.handles.clone(),
                sub: Some(index),
                rank,
                size,
                traffic: TrafficMeter::default(),
                queues: AtomicU64::new(0),
            }),
        }))
    }

    fn work_queue(&self, items: usize, chunk: usize) -> CommResult<Box<dyn WorkQueue + '_>> {
        // Each queue has its own tag, so a request for the next queue is never answered by
        // this one's dispatcher.
        let tag = 1000 + (self.inner.queues.fetch_add(1, Ordering::SeqCst) % 30_000) as i32;
        if self.inner.size == 1 {
            return Ok(Box::new(LocalQueue::new(items, chunk)));
        }
        if self.inner.rank == 0 {
            let local = LocalQueue::new(items, chunk);
            let (inner, shared) = (self.inner.clone(), local.clone());
            let dispatcher = std::thread::spawn(move || dispatch(&inner, &shared, tag));
            Ok(Box::new(RootQueue {
                local,
                dispatcher: Some(dispatcher),
            }))
        } else {
            Ok(Box::new(RemoteQueue {
                inner: self.inner.clone(),
                tag,
                done: false,
            }))
        }
    }

    fn traffic(&self) -> Traffic {
        self.inner.traffic.read()
    }
}

/// Rank 0's dispatcher: answers each request with the next chunk until every other rank has
/// been told the queue is empty.
fn dispatch(inner: &Inner, queue: &LocalQueue, tag: i32) -> CommResult<()> {
    let mut finished = 0;
    while finished + 1 < inner.size {
        let answered = {
            let handles = inner.lock()?;
            let comm = inner.comm(&handles);
            match comm.any_process().immediate_matched_probe_with_tag(tag) {
                Some(message) => {
                    let (_, status): (Vec<u64>, _) = message.matched_receive_vec();
                    let chunk = queue.take();
                    let reply = chunk.clone().map_or([0, 0], |r| [r.start as u64, r.end as u64]);
                    comm.process_at_rank(status.source_rank())
                        .send_with_tag(&reply[..], tag);
                    Some(chunk.is_none())
                }
                None => None,
            }
        };
        match answered {
            Some(true) => finished += 1,
            Some(false) => {}
            None => std::thread::sleep(Duration::from_micros(200)),
        }
    }
    Ok(())
}

struct RootQueue {
    local: LocalQueue,
    dispatcher: Option<JoinHandle<CommResult<()>>>,
}

impl RootQueue {
    fn join(&mut self) -> CommResult<()> {
        match self.dispatcher.take() {
            Some(handle) => handle
                .join()
                .map_err(|_| CommError::Failed("work-queue dispatcher panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl WorkQueue for RootQueue {
    fn next_chunk(&mut self) -> CommResult<Option<Range<usize>>> {
        match self.local.take() {
            Some(chunk) => Ok(Some(chunk)),
            None => {
                // Every other rank has been told the queue is empty once this returns, so the
                // next collective cannot cross a request.
                self.join()?;
                Ok(None)
            }
        }
    }
}

impl Drop for RootQueue {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

struct RemoteQueue {
    inner: Arc<Inner>,
    tag: i32,
    done: bool,
}

impl WorkQueue for RemoteQueue {
    fn next_chunk(&mut self) -> CommResult<Option<Range<usize>>> {
        if self.done {
            return Ok(None);
        }
        let handles = self.inner.lock()?;
        let root = self.inner.comm(&handles).process_at_rank(0);
        root.send_with_tag(&[self.inner.rank as u64][..], self.tag);
        let (reply, _) = root.receive_vec_with_tag::<u64>(self.tag);
        match reply.as_slice() {
            [start, end] if start < end => Ok(Some(*start as usize..*end as usize)),
            _ => {
                self.done = true;
                Ok(None)
            }
        }
    }
}

/// `piece`, or where it is empty, an empty slice of a real allocation: an empty slice's
/// address is 1, which OpenMPI reads as `MPI_IN_PLACE` (and `MPI_Gatherv` then refuses).
fn not_in_place(piece: &[u8]) -> &[u8] {
    static NOTHING: [u8; 1] = [0];
    match piece.is_empty() {
        true => &NOTHING[..0],
        false => piece,
    }
}

/// Every rank's part length (an all-gather of one `u64` each).
fn part_lengths(comm: &SimpleCommunicator, bytes: &[u8], size: usize) -> Vec<usize> {
    let mut lengths = vec![0u64; size];
    comm.all_gather_into(&(bytes.len() as u64), &mut lengths[..]);
    lengths.into_iter().map(|n| n as usize).collect()
}

/// The rounds a gather of parts of `lengths` bytes goes in: MPI's counts and displacements
/// are 32-bit, so each round moves at most 1 GiB in all (a 0.5B model's AdamW state is
/// 2 GB a rank at two ranks), every rank the next piece of its part.
struct Rounds<'a> {
    lengths: &'a [usize],
    per_rank: usize,
    next: usize,
    count: usize,
}

impl<'a> Rounds<'a> {
    fn new(lengths: &'a [usize]) -> Self {
        Self::with_limit(lengths, 1 << 30)
    }

    fn with_limit(lengths: &'a [usize], limit: usize) -> Self {
        let per_rank = (limit / lengths.len().max(1)).max(1);
        let longest = lengths.iter().copied().max().unwrap_or(0);
        Self {
            lengths,
            per_rank,
            next: 0,
            count: longest.div_ceil(per_rank),
        }
    }
}

impl<'a> Iterator for Rounds<'a> {
    type Item = Round<'a>;

    fn next(&mut self) -> Option<Round<'a>> {
        (self.next < self.count).then(|| {
            self.next += 1;
            Round {
                lengths: self.lengths,
                start: (self.next - 1) * self.per_rank,
                per_rank: self.per_rank,
            }
        })
    }
}

/// One round: each rank's bytes `start..start + per_rank` of its part (fewer at its end).
struct Round<'a> {
    lengths: &'a [usize],
    start: usize,
    per_rank: usize,
}

impl Round<'_> {
    fn mine(&self, rank: usize) -> Range<usize> {
        let end = self.lengths[rank].min(self.start + self.per_rank);
        self.start.min(end)..end
    }

    fn counts(&self) -> Vec<i32> {
        (0..self.lengths.len())
            .map(|r| self.mine(r).len() as i32)
            .collect()
    }

    fn displs(&self) -> Vec<i32> {
        self.counts()
            .iter()
            .scan(0i32, |acc, &n| {
                let at = *acc;
                *acc += n;
                Some(at)
            })
            .collect()
    }

    fn total(&self) -> usize {
        (0..self.lengths.len()).map(|r| self.mine(r).len()).sum()
    }

    /// Appends each rank's piece of `all` (the round's receive buffer) to its part.
    fn append(&self, all: &[u8], out: &mut [Vec<u8>]) {
        let mut at = 0;
        for (rank, part) in out.iter_mut().enumerate() {
            let n = self.mine(rank).len();
            part.extend_from_slice(&all[at..at + n]);
            at += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rounds;

    /// Parts of uneven lengths (one empty) moved in rounds of a few bytes come out whole, and
    /// no round moves more than the limit.
    #[test]
    fn rounds_move_every_part_whole_within_the_limit() {
        let parts: Vec<Vec<u8>> = [13usize, 0, 7, 29]
            .iter()
            .enumerate()
            .map(|(r, &n)| (0..n).map(|i| (r * 50 + i) as u8).collect())
            .collect();
        let lengths: Vec<usize> = parts.iter().map(Vec::len).collect();
        for limit in [1, 4, 10, 1 << 30] {
            let mut out = vec![Vec::new(); parts.len()];
            let mut rounds = 0;
            for round in Rounds::with_limit(&lengths, limit) {
                rounds += 1;
                assert!(round.total() <= limit.max(parts.len()), "limit {limit}");
                let all: Vec<u8> = (0..parts.len())
                    .flat_map(|r| parts[r][round.mine(r)].to_vec())
                    .collect();
                assert_eq!(all.len(), round.total());
                assert_eq!(round.displs().len(), round.counts().len());
                round.append(&all, &mut out);
            }
            assert_eq!(out, parts, "limit {limit}");
            let per_rank = (limit / parts.len()).max(1);
            assert_eq!(rounds, 29usize.div_ceil(per_rank), "limit {limit}");
        }
    }
}
