//! The process group a run trains in: who this process is, and the collectives data-parallel
//! training synchronises through.
//!
//! Trainers see only the [`Communicator`] trait. [`Single`] is one process (every collective a
//! no-op, no cost); `Mpi` (cargo feature `mpi`) is the processes `mpirun` or `srun` started,
//! on one node or many. A GPU implementation (NCCL) would be a third type behind the same
//! trait, its all-reduce on device buffers: trainers call [`Communicator::all_reduce`] on
//! flattened gradient buckets and never name the transport.
//!
//! `Nccl` (cargo feature `nccl`, `ALIGNER_COMM=nccl` under `mpirun`) moves the gradients'
//! all-reduce and reduce-scatter between GPUs on NCCL and leaves the rest on MPI.
//!
//! A program starts the group once with [`launch`], which returns a guard to keep until the
//! end of `main` (MPI must be finalised before the process exits), and reads it anywhere with
//! [`world`]. Without the `mpi` feature, or when no MPI launcher started the process, the
//! world is [`Single`] and everything behaves as in a one-process build.

#[cfg(feature = "mpi")]
mod mpi_world;
#[cfg(feature = "nccl")]
mod nccl_world;
mod queue;
mod threads;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use queue::{LocalQueue, WorkQueue};
pub use threads::Threads;

/// A collective failed (the group is broken: a peer died, or MPI was finalised).
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("communicator: {0}")]
    Failed(String),
}

pub type CommResult<T> = std::result::Result<T, CommError>;

/// How an all-reduce combines the ranks' buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size.
    Mean,
    Max,
}

/// What all-reduces have moved so far (for the benchmark table).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Traffic {
    pub calls: u64,
    /// Bytes this rank contributed.
    pub bytes: u64,
    pub seconds: f64,
}

/// A group of processes that train one model together.
pub trait Communicator: Send + Sync {
    /// This process's index, `0..world_size()`. Rank 0 writes the run folder.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Combines `buf` element-wise across ranks; every rank gets the result.
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> CommResult<()>;
    /// The same in double precision (metric sums, checksums).
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> CommResult<()>;
    /// Sums `send` element-wise across ranks and gives rank r only block r of the sum:
    /// `send` is `world_size()` blocks of `recv.len()` elements (the reduce-scatter of
    /// sharded gradients: each rank receives the summed gradients of what it owns).
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32]) -> CommResult<()>;
    /// Replaces `bytes` on every rank with `root`'s (lengths may differ before the call).
    fn broadcast(&self, bytes: &mut Vec<u8>, root: usize) -> CommResult<()>;
    /// Every rank's `bytes`, in rank order.
    fn all_gather(&self, bytes: &[u8]) -> CommResult<Vec<Vec<u8>>>;
    fn barrier(&self) -> CommResult<()>;
    /// Every rank's `bytes`, in rank order, on `root` alone (`None` on the other ranks, which
    /// receive nothing): what one rank writes, such as a checkpoint's optimizer state.
    fn gather(&self, bytes: &[u8], root: usize) -> CommResult<Option<Vec<Vec<u8>>>> {
        let all = self.all_gather(bytes)?;
        Ok((self.rank() == root).then_some(all))
    }
    /// A queue over `0..items` handed out `chunk` at a time to whichever rank asks first: a
    /// rank that finishes early takes more. Every rank must create it (a collective), and
    /// drain it before the next collective.
    fn work_queue(&self, items: usize, chunk: usize) -> CommResult<Box<dyn WorkQueue + '_>>;
    /// All-reduce traffic so far.
    fn traffic(&self) -> Traffic;
    /// The ranks that pass the same `color` as this one, as a communicator of their own,
    /// ordered by `key` (`MPI_Comm_split`; a collective: every rank calls it).
    fn split(&self, color: usize, key: usize) -> CommResult<Arc<dyn Communicator>>;
    /// [`Communicator::all_reduce`] (a sum) for a thread that runs beside one calling other
    /// collectives (the gradient buckets' in [`crate::overlap`]): where calls share one lock,
    /// it holds it only to start the sum and to look whether it is done, so the other thread's
    /// collectives go on meanwhile.
    fn all_reduce_polled(&self, buf: &mut [f32]) -> CommResult<()> {
        self.all_reduce(buf, ReduceOp::Sum)
    }

    fn is_root(&self) -> bool {
        self.rank() == 0
    }
}

/// One process: every collective returns at once.
#[derive(Debug, Default)]
pub struct Single;

impl Communicator for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce(&self, _: &mut [f32], _: ReduceOp) -> CommResult<()> {
        Ok(())
    }
    fn all_reduce_f64(&self, _: &mut [f64], _: ReduceOp) -> CommResult<()> {
        Ok(())
    }
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32]) -> CommResult<()> {
        check_blocks(send.len(), recv.len(), 1)?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn broadcast(&self, _: &mut Vec<u8>, _: usize) -> CommResult<()> {
        Ok(())
    }
    fn all_gather(&self, bytes: &[u8]) -> CommResult<Vec<Vec<u8>>> {
        Ok(vec![bytes.to_vec()])
    }
    fn barrier(&self) -> CommResult<()> {
        Ok(())
    }
    fn work_queue(&self, items: usize, chunk: usize) -> CommResult<Box<dyn WorkQueue + '_>> {
        Ok(Box::new(LocalQueue::new(items, chunk)))
    }
    fn traffic(&self) -> Traffic {
        Traffic::default()
    }
    fn split(&self, _: usize, _: usize) -> CommResult<Arc<dyn Communicator>> {
        Ok(Arc::new(Single))
    }
}

/// A `data × tensor` grid of ranks: the `tensor` ranks of one group split each layer of one
/// model between them (tensor parallel) and see the same examples; the groups are data-parallel
/// replicas. World rank `r` is tensor rank `r % tensor` of data rank `r / tensor`, so a tensor
/// group is consecutive ranks (one node's GPUs, where the launcher places ranks in order).
#[derive(Clone)]
pub struct Grid {
    /// The ranks of every tensor group that hold this rank's part of the model: the gradient
    /// all-reduce and the split of the data run over them.
    pub data: Arc<dyn Communicator>,
    /// This rank's tensor group.
    pub tensor: Arc<dyn Communicator>,
}

impl Grid {
    /// Splits `world` into groups of `tensor` consecutive ranks (a collective). Refused when
    /// `tensor` does not divide the world size.
    pub fn split(world: &dyn Communicator, tensor: usize) -> CommResult<Self> {
        let size = world.world_size();
        if tensor == 0 || !size.is_multiple_of(tensor) {
            return Err(CommError::Failed(format!(
                "parallel.tensor = {tensor} does not divide the {size} ranks into tensor groups"
            )));
        }
        let rank = world.rank();
        let (data_rank, tensor_rank) = (rank / tensor, rank % tensor);
        let tensor_group = world.split(data_rank, tensor_rank)?;
        let data = world.split(tensor_rank, data_rank)?;
        Ok(Self {
            data,
            tensor: tensor_group,
        })
    }
}

/// Every rank's `own` values (f32), in rank order: an all-gather of their bytes.
pub fn all_gather_f32(comm: &dyn Communicator, own: &[f32]) -> CommResult<Vec<Vec<f32>>> {
    Ok(comm
        .all_gather(&f32_bytes(own))?
        .iter()
        .map(|part| f32s(part))
        .collect())
}

/// [`all_gather_f32`] received by `root` alone (`None` on the other ranks).
pub fn gather_f32(comm: &dyn Communicator, own: &[f32], root: usize) -> CommResult<Option<Vec<Vec<f32>>>> {
    Ok(comm
        .gather(&f32_bytes(own), root)?
        .map(|parts| parts.iter().map(|part| f32s(part)).collect()))
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Refuses a reduce-scatter whose send buffer is not `world` blocks of the receive buffer.
pub(crate) fn check_blocks(send: usize, recv: usize, world: usize) -> CommResult<()> {
    if send != recv * world {
        return Err(CommError::Failed(format!(
            "reduce-scatter of {send} elements into blocks of {recv} over {world} ranks"
        )));
    }
    Ok(())
}

/// Counts all-reduce traffic for implementations.
#[derive(Debug, Default)]
pub(crate) struct TrafficMeter {
    calls: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
}

impl TrafficMeter {
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn record(&self, bytes: usize, took: Duration) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn read(&self) -> Traffic {
        Traffic {
            calls: self.calls.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            seconds: self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

static WORLD: OnceLock<Arc<dyn Communicator>> = OnceLock::new();

/// Keeps the process group alive; dropping it (at the end of `main`) finalises MPI.
#[must_use = "keep the guard until the program ends: dropping it finalises MPI"]
pub struct Launch {
    _private: (),
}

impl Launch {
    /// Ends every rank of the group at once with `code` (one rank's error must not leave the
    /// others waiting in a collective). With one process it simply exits.
    pub fn abort(self, code: i32) -> ! {
        #[cfg(feature = "mpi")]
        mpi_world::abort(code);
        std::process::exit(code)
    }
}

impl Drop for Launch {
    fn drop(&mut self) {
        #[cfg(feature = "mpi")]
        mpi_world::finalize();
    }
}

/// Starts the process group: MPI when this build has the `mpi` feature and the process was
/// started by an MPI launcher (`mpirun`, `mpiexec`, `srun`), one process otherwise. Call it
/// once, first thing in `main`.
pub fn launch() -> CommResult<Launch> {
    let world = start_world()?;
    let _ = WORLD.set(world);
    Ok(Launch { _private: () })
}

fn start_world() -> CommResult<Arc<dyn Communicator>> {
    let nccl = match std::env::var("ALIGNER_COMM").ok().as_deref() {
        None | Some("" | "mpi") => false,
        Some("nccl") if cfg!(feature = "nccl") => true,
        Some("nccl") => {
            return Err(CommError::Failed(
                "ALIGNER_COMM=nccl: this build has no NCCL: build with `--features nccl` (which \
                 brings `cuda` and `mpi`)"
                    .into(),
            ));
        }
        Some(other) => {
            return Err(CommError::Failed(format!(
                "ALIGNER_COMM={other:?}: expected mpi (the default) or nccl"
            )));
        }
    };
    #[cfg(feature = "mpi")]
    if launched_by_mpi() {
        let mpi: Arc<dyn Communicator> = Arc::new(mpi_world::Mpi::init()?);
        #[cfg(feature = "nccl")]
        if nccl {
            return Ok(Arc::new(nccl_world::Nccl::init(mpi)?));
        }
        return Ok(mpi);
    }
    if nccl {
        return Err(CommError::Failed(
            "ALIGNER_COMM=nccl: NCCL joins the ranks an MPI launcher started: run under `mpirun`".into(),
        ));
    }
    if let Some(size) = launcher_world_size().filter(|&n| n > 1) {
        // N copies of a one-process build would each train alone into the same run folder.
        return Err(CommError::Failed(format!(
            "started as one of {size} MPI ranks, but this build has no data parallelism: \
             build with `--features mpi` (e.g. `cargo build --release -p aligner-cli --features mpi`)"
        )));
    }
    Ok(Arc::new(Single))
}

/// The world size an MPI launcher announced in the environment, if any.
fn launcher_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// Whether an MPI launcher started this process (the variables OpenMPI, MPICH / Hydra, PMIx
/// and Slurm set for each rank).
pub fn launched_by_mpi() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "MPI_LOCALNRANKS",
        "SLURM_STEP_ID",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// The process group started by [`launch`]; [`Single`] when it was not called.
pub fn world() -> Arc<dyn Communicator> {
    WORLD.get_or_init(|| Arc::new(Single)).clone()
}

/// The items of `0..items` that rank `rank` of `world` takes when work is split in fixed
/// contiguous shards (the first `items % world` ranks take one more).
pub fn shard_range(items: usize, rank: usize, world: usize) -> Range<usize> {
    let world = world.max(1);
    let (base, extra) = (items / world, items % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_item_once_in_order() {
        for items in [0, 1, 5, 7, 12] {
            for world in 1..5 {
                let all: Vec<usize> = (0..world).flat_map(|r| shard_range(items, r, world)).collect();
                assert_eq!(all, (0..items).collect::<Vec<_>>(), "{items} items over {world}");
            }
        }
        assert_eq!(shard_range(7, 0, 3), 0..3);
        assert_eq!(shard_range(7, 2, 3), 5..7);
    }

    #[test]
    fn a_single_process_is_its_own_world() {
        let single = Single;
        let mut buf = vec![1.0f32, 2.0];
        single.all_reduce(&mut buf, ReduceOp::Mean).unwrap();
        assert_eq!(buf, vec![1.0, 2.0]);
        assert_eq!(single.all_gather(b"ab").unwrap(), vec![b"ab".to_vec()]);
        let mut queue = single.work_queue(5, 2).unwrap();
        let mut got = Vec::new();
        while let Some(r) = queue.next_chunk().unwrap() {
            got.push(r);
        }
        assert_eq!(got, vec![0..2, 2..4, 4..5]);
        assert!(world().world_size() >= 1);
    }
}
