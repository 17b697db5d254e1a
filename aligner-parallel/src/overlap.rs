//! Gradient buckets summed over the data-parallel ranks while the backward pass goes on
//! (PyTorch DDP's overlap), instead of after it.
//!
//! The trainable parameters are grouped, in reverse of their order in the model (the order
//! the backward pass completes them), into buckets of about `bucket_elements` values. During
//! an armed pass a model reads each parameter through [`grad_hook`]: an identity in the
//! forward that counts the read, and in the backward hands the read's gradient to the
//! [`Overlap`] (on the host) instead of to the parameter. When the last read of every
//! parameter of the next bucket has arrived, that bucket is summed over the ranks on a
//! thread of its own, while the backward pass computes the earlier layers' gradients.
//!
//! Every rank starts the buckets in the same order (bucket `k + 1` never before bucket `k`),
//! so the collectives match whatever the timing. Whatever was not summed that way (a read
//! whose gradient came after its bucket had left, a parameter read without the hook, a rank
//! that sat a pass out) is summed at [`Overlap::finish`], which also starts any bucket still
//! waiting: the sums are exact whatever the hooks saw, and overlap is only a matter of time.
//!
//! Gradient accumulation: the earlier micro-batches' passes ([`Overlap::arm`] with
//! `last = false`) only add their gradients up on the host; the last one's sends them.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;

#[cfg(feature = "cube")]
use burn::backend::Cube;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Backend, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::Tensor;

use crate::comm::{CommError, CommResult, Communicator, ReduceOp};

/// One trainable parameter's gradient on its way through a step.
struct Slot {
    id: u64,
    len: usize,
    bucket: usize,
    /// Reads of the last pass whose gradient has not arrived yet.
    pending: usize,
    /// This rank's gradient so far (none arrived = `None`).
    sum: Option<Vec<f32>>,
    /// Gradient that arrived after the slot's bucket had left.
    late: Option<Vec<f32>>,
    /// Whether the bucket carried a gradient of this rank's.
    sent: bool,
}

/// A bucket's sum from the reducing thread.
struct Reduced {
    bucket: usize,
    values: CommResult<Vec<f32>>,
    seconds: f64,
}

/// What the hooks and the trainer share.
struct State {
    slots: Vec<Slot>,
    by_id: HashMap<u64, usize>,
    /// Slot indices of each bucket, in the order buckets leave.
    buckets: Vec<Vec<usize>>,
    /// The next bucket to leave.
    next: usize,
    /// Whether a step is under way ([`Overlap::arm`] until [`Overlap::finish`]).
    armed: bool,
    /// Whether the pass under way is the step's last (its gradients leave as they complete).
    last: bool,
    /// Buckets that left before [`Overlap::finish`] this step.
    early: usize,
    jobs: Sender<(usize, Vec<f32>)>,
}

impl State {
    fn arrive(&mut self, slot: usize, values: Vec<f32>) {
        // A backward after its step ended has no step to add to.
        if !self.armed {
            return;
        }
        let bucket = self.slots[slot].bucket;
        let s = &mut self.slots[slot];
        let into = if bucket < self.next {
            &mut s.late
        } else {
            &mut s.sum
        };
        add_into(into, values);
        if self.last {
            s.pending = s.pending.saturating_sub(1);
            self.send_ready();
        }
    }

    /// Sends every bucket, in order, whose parameters have all their gradients.
    fn send_ready(&mut self) {
        while self.next < self.buckets.len()
            && self.buckets[self.next]
                .iter()
                .all(|&i| self.slots[i].pending == 0)
        {
            self.send_next();
            self.early += 1;
        }
    }

    fn send_next(&mut self) {
        let bucket = self.next;
        let mut values = Vec::new();
        for &i in &self.buckets[bucket] {
            let slot = &mut self.slots[i];
            match slot.sum.take() {
                Some(sum) => {
                    values.extend_from_slice(&sum);
                    slot.sent = true;
                }
                None => values.extend(std::iter::repeat_n(0.0, slot.len)),
            }
        }
        self.next += 1;
        // The thread lives as long as the `Overlap`; a send can only fail after it panicked,
        // which `finish` reports.
        let _ = self.jobs.send((bucket, values));
    }
}

/// Adds `values` into `sum` (which becomes them when it holds none yet).
fn add_into(sum: &mut Option<Vec<f32>>, values: Vec<f32>) {
    match sum {
        Some(sum) => sum.iter_mut().zip(&values).for_each(|(a, b)| *a += b),
        None => *sum = Some(values),
    }
}

/// Figures of the overlapped reductions since the [`Overlap`] was made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OverlapStats {
    /// Steps finished.
    pub steps: u64,
    /// Buckets summed, and those of them sent while the backward pass was still running.
    pub buckets: u64,
    pub early_buckets: u64,
    /// Seconds the reducing thread spent summing buckets, plus the sums `finish` ran itself.
    pub comm_seconds: f64,
    /// Seconds the trainer waited for sums in `finish` (communication not hidden).
    pub exposed_seconds: f64,
    /// Bytes of gradient this rank sent into the sums.
    pub bytes: u64,
}

impl OverlapStats {
    /// What happened after `earlier` (figures of the same overlap).
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            steps: self.steps - earlier.steps,
            buckets: self.buckets - earlier.buckets,
            early_buckets: self.early_buckets - earlier.early_buckets,
            comm_seconds: self.comm_seconds - earlier.comm_seconds,
            exposed_seconds: self.exposed_seconds - earlier.exposed_seconds,
            bytes: self.bytes - earlier.bytes,
        }
    }

    /// Seconds of communication that ran while the trainer computed.
    pub fn overlapped_seconds(&self) -> f64 {
        (self.comm_seconds - self.exposed_seconds).max(0.0)
    }
}

type Shared = Arc<Mutex<State>>;

/// The overlap of one trainer's gradient sums with its backward passes; see the module docs.
pub struct Overlap {
    state: Shared,
    done: Receiver<Reduced>,
    thread: Option<JoinHandle<()>>,
    bucket_elements: usize,
    stats: OverlapStats,
}

/// The armed overlap the hooks report to (one trainer at a time).
static ACTIVE: RwLock<Option<Shared>> = RwLock::new(None);

fn lock(state: &Shared) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Overlap {
    /// An overlap summing over the ranks of `comm` in buckets of about `bucket_elements`
    /// values. A collective (it splits off a communicator for its thread): every rank calls it.
    pub fn new(comm: &dyn Communicator, bucket_elements: usize) -> CommResult<Self> {
        let reducer = comm.split(0, comm.rank())?;
        let (jobs, todo) = channel::<(usize, Vec<f32>)>();
        let (sums, done) = channel();
        let thread = std::thread::Builder::new()
            .name("aligner-grad-buckets".into())
            .spawn(move || reduce_buckets(reducer, todo, sums))
            .map_err(|e| CommError::Failed(format!("starting the gradient-bucket thread: {e}")))?;
        Ok(Self {
            state: Arc::new(Mutex::new(State {
                slots: Vec::new(),
                by_id: HashMap::new(),
                buckets: Vec::new(),
                next: 0,
                armed: false,
                last: false,
                early: 0,
                jobs,
            })),
            done,
            thread: Some(thread),
            bucket_elements: bucket_elements.max(1),
            stats: OverlapStats::default(),
        })
    }

    /// Arms the hooks for a pass of a step over the trainable parameters `params` (ids and
    /// element counts, in the model's order); `last` for the step's last pass (its
    /// gradients leave as they complete). Call before the pass's forward.
    pub fn arm(&mut self, params: &[(u64, usize)], last: bool) {
        let mut state = lock(&self.state);
        let same = state.slots.len() == params.len()
            && state
                .slots
                .iter()
                .zip(params)
                .all(|(s, &(id, len))| s.id == id && s.len == len);
        if !same {
            self.layout(&mut state, params);
        }
        state.armed = true;
        state.last = last;
        if last {
            state.slots.iter_mut().for_each(|s| s.pending = 0);
        }
        drop(state);
        *ACTIVE.write().unwrap_or_else(|p| p.into_inner()) = Some(self.state.clone());
    }

    /// The buckets: parameters from the last to the first, a new bucket begun where the next
    /// parameter would take the current one past `bucket_elements` values (a larger
    /// parameter has a bucket of its own).
    fn layout(&self, state: &mut State, params: &[(u64, usize)]) {
        state.slots = params
            .iter()
            .map(|&(id, len)| Slot {
                id,
                len,
                bucket: 0,
                pending: 0,
                sum: None,
                late: None,
                sent: false,
            })
            .collect();
        state.by_id = params.iter().enumerate().map(|(i, &(id, _))| (id, i)).collect();
        state.buckets = Vec::new();
        let mut filled = 0;
        for i in (0..params.len()).rev() {
            if state.buckets.is_empty() || (filled > 0 && filled + params[i].1 > self.bucket_elements) {
                state.buckets.push(Vec::new());
                filled = 0;
            }
            let bucket = state.buckets.len() - 1;
            state.buckets[bucket].push(i);
            state.slots[i].bucket = bucket;
            filled += params[i].1;
        }
    }

    /// Whether a step is armed (its gradients go through [`Overlap::finish`]).
    pub fn armed(&self) -> bool {
        lock(&self.state).armed
    }

    /// Ends the step: sends the buckets still waiting, waits for every sum, and sums over
    /// `comm` (the ranks the buckets go over) what came late together with `unhooked`, each
    /// parameter's gradient that did not pass a hook (in the model's order). Each parameter's
    /// sum over the ranks out, in the model's order; `None` where no rank had a gradient.
    /// A collective: every rank calls it once a step.
    pub fn finish(
        &mut self,
        comm: &dyn Communicator,
        mut unhooked: Vec<Option<Vec<f32>>>,
    ) -> CommResult<Vec<Option<Vec<f32>>>> {
        *ACTIVE.write().unwrap_or_else(|p| p.into_inner()) = None;
        let mut state = lock(&self.state);
        if unhooked.len() != state.slots.len() {
            return Err(CommError::Failed(format!(
                "gradient buckets: {} gradients for {} parameters",
                unhooked.len(),
                state.slots.len()
            )));
        }
        let early = state.early;
        while state.next < state.buckets.len() {
            state.send_next();
        }
        let count = state.buckets.len();
        drop(state);
        let waited = Instant::now();
        let mut sums: Vec<Option<Vec<f32>>> = vec![None; count];
        for _ in 0..count {
            let reduced = self
                .done
                .recv()
                .map_err(|_| CommError::Failed("the gradient-bucket thread stopped".into()))?;
            self.stats.comm_seconds += reduced.seconds;
            let values = reduced.values?;
            self.stats.bytes += std::mem::size_of_val(values.as_slice()) as u64;
            sums[reduced.bucket] = Some(values);
        }
        self.stats.exposed_seconds += waited.elapsed().as_secs_f64();
        let mut state = lock(&self.state);
        let n = state.slots.len();
        // Each parameter's part of its bucket's sum (a bucket holds its parameters from the
        // last to the first).
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); n];
        for (bucket, members) in state.buckets.iter().enumerate() {
            let Some(values) = sums[bucket].take() else {
                continue;
            };
            let mut offset = 0;
            for &i in members {
                let len = state.slots[i].len;
                out[i] = values[offset..offset + len].to_vec();
                offset += len;
            }
        }
        // Per parameter: whether this rank had a gradient, and whether some of it is late.
        let mut flags = vec![0.0f32; 2 * n];
        for (i, slot) in state.slots.iter_mut().enumerate() {
            let mut late = slot.late.take();
            if let Some(values) = unhooked[i].take() {
                add_into(&mut late, values);
            }
            flags[i] = f32::from(u8::from(slot.sent || late.is_some()));
            flags[n + i] = f32::from(u8::from(late.is_some()));
            unhooked[i] = late;
            slot.sent = false;
            slot.sum = None;
            slot.pending = 0;
        }
        state.next = 0;
        state.early = 0;
        state.armed = false;
        state.last = false;
        let lens: Vec<usize> = state.slots.iter().map(|s| s.len).collect();
        drop(state);
        drop(sums);
        let started = Instant::now();
        comm.all_reduce(&mut flags, ReduceOp::Sum)?;
        // What came late, summed in one more pass (zeros where this rank had none).
        let late: Vec<usize> = (0..n).filter(|&i| flags[n + i] > 0.0).collect();
        if !late.is_empty() {
            let mut values = Vec::new();
            for &i in &late {
                match unhooked[i].take() {
                    Some(v) => values.extend_from_slice(&v),
                    None => values.extend(std::iter::repeat_n(0.0, lens[i])),
                }
            }
            self.stats.bytes += std::mem::size_of_val(values.as_slice()) as u64;
            for chunk in values.chunks_mut(self.bucket_elements) {
                comm.all_reduce(chunk, ReduceOp::Sum)?;
            }
            let mut offset = 0;
            for &i in &late {
                let part = &values[offset..offset + lens[i]];
                offset += lens[i];
                out[i].iter_mut().zip(part).for_each(|(a, b)| *a += b);
            }
        }
        let took = started.elapsed().as_secs_f64();
        self.stats.comm_seconds += took;
        self.stats.exposed_seconds += took;
        self.stats.steps += 1;
        self.stats.buckets += count as u64;
        self.stats.early_buckets += early as u64;
        Ok(out
            .into_iter()
            .enumerate()
            .map(|(i, v)| (flags[i] > 0.0).then_some(v))
            .collect())
    }

    /// The figures so far.
    pub fn stats(&self) -> OverlapStats {
        self.stats
    }
}

impl Drop for Overlap {
    fn drop(&mut self) {
        let mut active = ACTIVE.write().unwrap_or_else(|p| p.into_inner());
        if active.as_ref().is_some_and(|a| Arc::ptr_eq(a, &self.state)) {
            *active = None;
        }
        drop(active);
        // Closing the queue ends the thread.
        let (closed, _) = channel();
        lock(&self.state).jobs = closed;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The reducing thread: sums each bucket over `comm` as it comes.
fn reduce_buckets(comm: Arc<dyn Communicator>, todo: Receiver<(usize, Vec<f32>)>, done: Sender<Reduced>) {
    while let Ok((bucket, mut values)) = todo.recv() {
        let started = Instant::now();
        let result = comm.all_reduce_polled(&mut values).map(|()| values);
        let reduced = Reduced {
            bucket,
            values: result,
            seconds: started.elapsed().as_secs_f64(),
        };
        if done.send(reduced).is_err() {
            return;
        }
    }
}

/// The hook of the parameter `id` when an armed [`Overlap`] sums its gradient.
pub fn hook_of(id: u64) -> Option<Hook> {
    let active = ACTIVE.read().unwrap_or_else(|p| p.into_inner());
    let state = active.as_ref()?;
    let slot = *lock(state).by_id.get(&id)?;
    Some(Hook {
        state: state.clone(),
        slot,
    })
}

/// Where a read's gradient goes: its [`Overlap`]'s slot.
#[derive(Clone)]
pub struct Hook {
    state: Shared,
    slot: usize,
}

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hook {{ slot: {} }}", self.slot)
    }
}

impl Hook {
    fn note_read(&self) {
        let mut state = lock(&self.state);
        if state.last {
            state.slots[self.slot].pending += 1;
        }
    }

    fn arrive(&self, values: Vec<f32>) {
        lock(&self.state).arrive(self.slot, values);
    }
}

/// The hook as a Burn backend extension: an identity without gradients on any backend;
/// autodiff over any backend counts the read and hands its gradient to the overlap.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait OverlapOps: Backend {
    /// `value` itself; `anchor` only places the backward right after its user's.
    fn grad_hook(value: FloatTensor<Self>, anchor: FloatTensor<Self>, hook: Hook) -> FloatTensor<Self> {
        let _ = (anchor, hook);
        value
    }
}

impl OverlapOps for Flex {}

#[cfg(feature = "cube")]
impl OverlapOps for Cube {}

#[derive(Debug)]
struct HookBackward;

impl<B: Backend> Backward<B, 2> for HookBackward {
    type State = Hook;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (values, _) = crate::fused::host_values::<B>(grad);
        ops.state.arrive(values);
    }
}

impl<B: Backend + OverlapOps, C: CheckpointStrategy> OverlapOps for Autodiff<B, C> {
    fn grad_hook(value: FloatTensor<Self>, anchor: FloatTensor<Self>, hook: Hook) -> FloatTensor<Self> {
        let nodes = [value.node(), anchor.node()];
        let inner = value.into_primitive();
        match HookBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                hook.note_read();
                prep.finish(hook, inner)
            }
            OpsKind::UnTracked(prep) => prep.finish(inner),
        }
    }
}

/// [`OverlapOps::grad_hook`] on tensors: `value` (a parameter's), whose gradient goes to
/// `hook`'s overlap; `anchor` (the activation it is used with) places its backward right
/// after its user's.
pub fn grad_hook<const D: usize, const E: usize>(
    value: Tensor<D>,
    anchor: &Tensor<E>,
    hook: Hook,
) -> Tensor<D> {
    use burn::backend::Dispatch;
    Tensor::from_dispatch(<Dispatch as OverlapOps>::grad_hook(
        value.into_dispatch(),
        anchor.clone().into_dispatch(),
        hook,
    ))
}
