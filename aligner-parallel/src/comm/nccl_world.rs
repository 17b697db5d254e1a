//! The process group's gradient collectives on NCCL (cargo feature `nccl`), everything else on
//! MPI: `mpirun` starts the ranks, MPI bootstraps NCCL (rank 0 makes the unique id and
//! broadcasts it), and each rank drives the GPU of its node-local rank.
//!
//! NCCL carries what is large and on every step: [`Communicator::all_reduce`] and
//! [`Communicator::reduce_scatter`] of the gradient buckets, between GPUs over NVLink or the
//! network instead of through the hosts' MPI. The buckets the trainers hand over are host
//! slices (the gradients flattened), so each call copies its bucket to the device and back.
//! Decisions, gathers of rollouts and the work queue stay on MPI.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};

use super::{CommError, CommResult, Communicator, ReduceOp, Traffic, TrafficMeter, WorkQueue};

/// One NCCL communicator, used by one call at a time.
struct Serial(Comm);

// SAFETY: an NCCL communicator may be driven from any thread as long as calls on it do not
// overlap; every call goes through the `Mutex` below.
unsafe impl Send for Serial {}

/// NCCL for the gradients' collectives, `mpi` (the world that started the ranks) for the rest.
pub(crate) struct Nccl {
    mpi: Arc<dyn Communicator>,
    comm: Mutex<Serial>,
    stream: Arc<CudaStream>,
    traffic: TrafficMeter,
}

fn failed(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Failed(format!("NCCL: {what}: {e:?}"))
}

/// The GPU this rank drives: its rank on the node (the launcher's local rank), modulo the GPUs
/// the node has.
fn local_device(mpi: &dyn Communicator) -> CommResult<usize> {
    let local = ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())
        .unwrap_or(mpi.rank());
    let count = CudaContext::device_count().map_err(|e| failed("counting GPUs", e))?;
    if count < 1 {
        return Err(CommError::Failed("NCCL: no CUDA device on this node".into()));
    }
    Ok(local % count as usize)
}

impl Nccl {
    /// Joins every rank of `mpi` into one NCCL communicator (a collective over `mpi`).
    pub(crate) fn init(mpi: Arc<dyn Communicator>) -> CommResult<Self> {
        let ordinal = local_device(mpi.as_ref())?;
        let context = CudaContext::new(ordinal).map_err(|e| failed("opening the GPU", e))?;
        let stream = context.default_stream();
        let mut id_bytes = Vec::new();
        if mpi.is_root() {
            let id = Id::new().map_err(|e| failed("making the unique id", e))?;
            id_bytes = id.internal().iter().map(|&c| c as u8).collect();
        }
        mpi.broadcast(&mut id_bytes, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        if id_bytes.len() != internal.len() {
            return Err(CommError::Failed(format!(
                "NCCL: rank 0 sent a unique id of {} bytes, expected 128",
                id_bytes.len()
            )));
        }
        for (slot, byte) in internal.iter_mut().zip(&id_bytes) {
            *slot = *byte as std::ffi::c_char;
        }
        let comm = Comm::from_rank(stream.clone(), mpi.rank(), mpi.world_size(), Id::uninit(internal))
            .map_err(|e| failed("joining the communicator", e))?;
        tracing::info!(rank = mpi.rank(), gpu = ordinal, "NCCL communicator ready");
        Ok(Self {
            mpi,
            comm: Mutex::new(Serial(comm)),
            stream,
            traffic: TrafficMeter::default(),
        })
    }

    fn lock(&self) -> CommResult<std::sync::MutexGuard<'_, Serial>> {
        self.comm
            .lock()
            .map_err(|_| CommError::Failed("NCCL: a collective panicked on another thread".into()))
    }
}

impl Communicator for Nccl {
    fn rank(&self) -> usize {
        self.mpi.rank()
    }

    fn world_size(&self) -> usize {
        self.mpi.world_size()
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> CommResult<()> {
        let started = Instant::now();
        let op = match op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Mean => NcclOp::Avg,
            ReduceOp::Max => NcclOp::Max,
        };
        let comm = self.lock()?;
        let mut device = self
            .stream
            .clone_htod(&*buf)
            .map_err(|e| failed("copying to the GPU", e))?;
        comm.0
            .all_reduce_in_place(&mut device, &op)
            .map_err(|e| failed("all-reduce", e))?;
        self.stream
            .memcpy_dtoh(&device, buf)
            .map_err(|e| failed("copying from the GPU", e))?;
        self.stream
            .synchronize()
            .map_err(|e| failed("synchronising", e))?;
        self.traffic.record(std::mem::size_of_val(buf), started.elapsed());
        Ok(())
    }

    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> CommResult<()> {
        self.mpi.all_reduce_f64(buf, op)
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32]) -> CommResult<()> {
        super::check_blocks(send.len(), recv.len(), self.world_size())?;
        let started = Instant::now();
        let comm = self.lock()?;
        let device_send = self
            .stream
            .clone_htod(send)
            .map_err(|e| failed("copying to the GPU", e))?;
        let mut device_recv = self
            .stream
            .alloc_zeros::<f32>(recv.len())
            .map_err(|e| failed("allocating on the GPU", e))?;
        comm.0
            .reduce_scatter(&device_send, &mut device_recv, &NcclOp::Sum)
            .map_err(|e| failed("reduce-scatter", e))?;
        self.stream
            .memcpy_dtoh(&device_recv, recv)
            .map_err(|e| failed("copying from the GPU", e))?;
        self.stream
            .synchronize()
            .map_err(|e| failed("synchronising", e))?;
        self.traffic
            .record(std::mem::size_of_val(send), started.elapsed());
        Ok(())
    }

    fn broadcast(&self, bytes: &mut Vec<u8>, root: usize) -> CommResult<()> {
        self.mpi.broadcast(bytes, root)
    }

    fn all_gather(&self, bytes: &[u8]) -> CommResult<Vec<Vec<u8>>> {
        self.mpi.all_gather(bytes)
    }

    fn gather(&self, bytes: &[u8], root: usize) -> CommResult<Option<Vec<Vec<u8>>>> {
        self.mpi.gather(bytes, root)
    }

    fn barrier(&self) -> CommResult<()> {
        self.mpi.barrier()
    }

    fn work_queue(&self, items: usize, chunk: usize) -> CommResult<Box<dyn WorkQueue + '_>> {
        self.mpi.work_queue(items, chunk)
    }

    /// Split on MPI: a sub-group's collectives (tensor parallel's activations) run on the
    /// hosts.
    fn split(&self, color: usize, key: usize) -> CommResult<Arc<dyn Communicator>> {
        self.mpi.split(color, key)
    }

    fn traffic(&self) -> Traffic {
        self.traffic.read()
    }
}
