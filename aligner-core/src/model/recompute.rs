//! Full activation recomputation, a decoder layer at a time (`train.activation_checkpointing =
//! true`; HF's gradient checkpointing).
//!
//! While a [`LayerRecompute`] is armed, a training forward pass of [`LlamaModel`] runs its
//! embedding and decoder layers on a frozen copy of the parameters (no graph), keeping only
//! each layer's input, and hands
//! the head a fresh leaf in place of the last layer's output: autodiff records the final norm,
//! the head and the loss alone. [`gradients`] then runs the loss's backward pass down to that
//! leaf, and walks the layers from the top: it reruns one layer with autodiff from its kept
//! input, backpropagates the gradient of its output through it (`Σ out · g`), takes the
//! layer's parameter gradients and the gradient of its input, and drops the layer's graph
//! before the next. The embedding's gradient comes last the same way. At most one layer's
//! activations exist at a time, beside the kept inputs.
//!
//! The collectives of a split model (a fully sharded weight's gather and reduce-scatter, a
//! tensor group's reductions) run inside the reruns as they do in an ordinary pass, in the
//! same order on every rank. Gradients equal the ordinary pass's (the kept inputs are the
//! values the layers saw; the reruns compute them the same way).
//!
//! LoRA dropout draws the same masks in a rerun as in the pass it reruns: a training pass of a
//! model with dropout seeds the device's generator before each layer ([`DropoutSeeds`], from
//! one draw of the generator at the pass's start), the rerun seeds it the same way, and the
//! generator is left where the ordinary pass leaves it. An ordinary pass seeds the same way,
//! so its masks, and its gradients, are the recomputed pass's.
//!
//! A mixture of experts' load-balancing loss is linear in each layer's router probability
//! sums: a recomputed pass records its (untracked) routing, the loss takes the sums through
//! one leaf ([`super::with_router_loss`]), and each layer's rerun adds `Σ sums · ∂loss/∂leaf`
//! to what it backpropagates, under the pass's padding marks.
//!
//! A layer's routing enters that loss only where the ordinary pass tracks its router
//! probabilities (the router trains, or something before it does: with LoRA on the experts
//! alone, a first layer's does not); the recomputed pass records, and the reruns add, those
//! layers' alone.
//!
//! Not recomputed: a forward with a KV cache (generation) and a model with no trainable
//! parameter in its layers (a frozen reference): these run as an ordinary autodiff pass.

use std::cell::{Cell, RefCell};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Bool, Int, Tensor};

use super::rope::RotaryAngles;
use super::{FeedForward, LlamaModel, layer};

/// Decoder-layer passes rerun by [`gradients`] in this process.
static RERUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many decoder-layer passes [`gradients`] has rerun in this process (the run's log
/// reports it, which shows the option at work).
pub fn reruns() -> usize {
    RERUNS.load(std::sync::atomic::Ordering::Relaxed)
}

thread_local! {
    static ARMED: Cell<usize> = const { Cell::new(0) };
    static TAPE: RefCell<Vec<Record>> = const { RefCell::new(Vec::new()) };
    /// Whether the recomputed pass's layer running now records its (untracked) routing: where
    /// the ordinary pass's router probabilities would take part in autodiff.
    static RECORD_ROUTING: Cell<bool> = const { Cell::new(false) };
}

/// Whether a mixture of experts running now records its routing though untracked (a
/// recomputed pass's layer whose routing the ordinary pass would track).
pub(super) fn records_untracked_routing() -> bool {
    RECORD_ROUTING.with(Cell::get)
}

/// How many recomputed passes wait for their backward on this thread.
pub(super) fn tape_len() -> usize {
    TAPE.with(|t| t.borrow().len())
}

/// Gives the recomputed passes `passes` (positions on the tape) the leaf through which their
/// routing entered the load-balancing loss (see [`super::with_router_loss`]).
pub(super) fn attach_router_leaf(passes: std::ops::Range<usize>, leaf: &Tensor<1>) {
    TAPE.with(|t| {
        for record in &mut t.borrow_mut()[passes] {
            record.router_leaf = Some(leaf.clone());
        }
    });
}

/// While alive, training forward passes on this thread keep only their layers' inputs, and
/// [`gradients`] recomputes the layers (see the module's docs). Dropping it discards what
/// no backward pass took.
#[must_use = "recomputation is armed only while the guard lives"]
pub struct LayerRecompute {
    _thread_bound: std::marker::PhantomData<*const ()>,
}

impl LayerRecompute {
    /// Arms recomputation when `on` (`train.activation_checkpointing = true`); `None` leaves
    /// every pass ordinary.
    pub fn arm(on: bool) -> Option<Self> {
        on.then(|| {
            ARMED.with(|a| a.set(a.get() + 1));
            Self {
                _thread_bound: std::marker::PhantomData,
            }
        })
    }
}

impl Drop for LayerRecompute {
    fn drop(&mut self) {
        let left = ARMED.with(|a| {
            a.set(a.get().saturating_sub(1));
            a.get()
        });
        if left == 0 {
            TAPE.with(|t| t.borrow_mut().clear());
        }
    }
}

/// Whether a [`LayerRecompute`] is armed on this thread.
pub fn armed() -> bool {
    ARMED.with(|a| a.get() > 0)
}

/// One recomputed forward pass: what its backward needs to rerun the layers.
struct Record {
    /// The model as trained (autodiff parameters).
    model: LlamaModel,
    tokens: Tensor<2, Int>,
    angles: RotaryAngles,
    local: Option<RotaryAngles>,
    mask: Option<Tensor<4, Bool>>,
    /// Each layer's input, tracked by no graph.
    inputs: Vec<Tensor<3>>,
    /// The leaf standing for the last layer's output.
    leaf: Tensor<3>,
    /// The pass's dropout seeds, when it applied dropout.
    seeds: Option<DropoutSeeds>,
    /// The tokens the pass marked as not padding (a mixture of experts' load-balancing loss
    /// counts those alone).
    valid: Option<Vec<bool>>,
    /// Where the pass's routing entered the load-balancing loss, if it did.
    router_leaf: Option<Tensor<1>>,
    /// Which layers' routing entered it (see [`routing_tracked`]).
    routed: Vec<bool>,
}

/// For each layer of `model`, whether an ordinary training pass's router probabilities take
/// part in autodiff, and so its routing in the load-balancing loss (see `moe`): its router
/// trains, or something its input depends on does (the embedding, an earlier layer, the
/// layer's attention and norms). With LoRA on the experts alone, a first layer's does not.
fn routing_tracked(model: &LlamaModel) -> Vec<bool> {
    let mut upstream = trains(&model.embed_tokens);
    model
        .layers
        .iter()
        .map(|l| {
            let norms = [&l.attn_norm_in, &l.attn_norm_out, &l.mlp_norm_in];
            let input =
                upstream || trains(&l.self_attn) || norms.iter().any(|n| n.as_ref().is_some_and(trains));
            upstream = upstream || trains(l);
            match &l.mlp {
                FeedForward::Sparse(moe) => input || trains(&moe.router),
                FeedForward::Dense(_) => false,
            }
        })
        .collect()
}

/// Whether any LoRA adapter of `model`'s layers has dropout.
fn uses_dropout(model: &LlamaModel) -> bool {
    model.layers.iter().any(|l| {
        let FeedForward::Dense(mlp) = &l.mlp else {
            return false;
        };
        l.self_attn
            .qkv
            .iter()
            .chain([&l.self_attn.o_proj])
            .chain(&mlp.gate_up)
            .chain([&mlp.down_proj])
            .any(|p| p.lora.as_ref().is_some_and(|a| a.dropout.prob > 0.0))
    })
}

/// The seeds of a training pass's dropout masks, one per decoder layer, derived from one draw
/// of the device's generator: a rerun of layer `i` seeded with [`DropoutSeeds::before_layer`]
/// draws the masks the pass drew.
#[derive(Clone)]
pub(super) struct DropoutSeeds {
    device: crate::Device,
    base: u64,
    layers: u64,
}

impl DropoutSeeds {
    /// The seeds of a forward pass of `model`, when it applies dropout: LoRA adapters with
    /// dropout in layers that train, on an autodiff device (elsewhere dropout is the identity).
    pub(super) fn draw(model: &LlamaModel) -> Option<Self> {
        let device = model.embed_tokens.weight.device();
        if !device.is_autodiff() || !uses_dropout(model) || !model.layers.iter().any(trains) {
            return None;
        }
        let draw = Tensor::<1>::random([2], burn::tensor::Distribution::Uniform(0.0, 1.0), &device)
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap_or_default();
        let bits = |i: usize| (draw.get(i).copied().unwrap_or(0.0) as f64 * (1u64 << 24) as f64) as u64;
        Some(Self {
            device,
            base: (bits(0) << 24) | bits(1),
            layers: model.layers.len() as u64,
        })
    }

    /// Seeds the generator for layer `layer`'s masks.
    pub(super) fn before_layer(&self, layer: usize) {
        self.device.seed(splitmix64(self.base.wrapping_add(layer as u64)));
    }

    /// Leaves the generator where the pass leaves it: seeded past every layer's seed.
    pub(super) fn after_pass(&self) {
        self.device.seed(splitmix64(self.base.wrapping_add(self.layers)));
    }
}

/// SplitMix64's output function: well-spread seeds from consecutive integers.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Whether any parameter of `module` takes part in a backward pass.
fn trains<M: Module>(module: &M) -> bool {
    struct Trainable(bool);
    impl ModuleVisitor for Trainable {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 |= param.val().is_require_grad();
        }
    }
    let mut found = Trainable(false);
    module.visit(&mut found);
    found.0
}

/// Whether this forward pass of `model` is to be recomputed: armed, without a cache, on a
/// model whose layers train.
pub(super) fn applies(model: &LlamaModel, cached: bool) -> bool {
    !cached && armed() && model.layers.iter().any(trains)
}

/// The forward pass of [`LlamaModel::forward`] for [`applies`]: the layers without autodiff,
/// their inputs kept for [`gradients`]; the final norm on a fresh leaf.
pub(super) fn forward(
    model: &LlamaModel,
    tokens: Tensor<2, Int>,
    angles: RotaryAngles,
    local: Option<RotaryAngles>,
    mask: Option<&Tensor<4, Bool>>,
) -> Tensor<3> {
    // The same parameters, on the same device, tracked by no graph: the pass computes with the
    // kernels the reruns use (the same values), and autodiff keeps nothing of it.
    // Dropout stays on in it (`freeze` would turn it off), drawing what the reruns draw.
    let seeds = DropoutSeeds::draw(model);
    let frozen = without_gradients(model.clone());
    let mut x = frozen.embed(tokens.clone());
    let mut inputs = Vec::with_capacity(frozen.layers.len());
    let routed = routing_tracked(model);
    struct RoutingRecorded;
    impl Drop for RoutingRecorded {
        fn drop(&mut self) {
            RECORD_ROUTING.with(|f| f.set(false));
        }
    }
    let recorded = RoutingRecorded;
    for (i, &routes) in routed.iter().enumerate() {
        inputs.push(x.clone());
        RECORD_ROUTING.with(|f| f.set(routes));
        x = frozen.layer_forward(i, x, (&angles, local.as_ref()), mask, None, seeds.as_ref());
    }
    drop(recorded);
    if let Some(seeds) = &seeds {
        seeds.after_pass();
    }
    let leaf = x.detach().require_grad();
    TAPE.with(|t| {
        t.borrow_mut().push(Record {
            model: model.clone(),
            tokens,
            angles,
            local,
            mask: mask.cloned(),
            inputs,
            leaf: leaf.clone(),
            seeds,
            valid: super::moe::valid_tokens(),
            router_leaf: None,
            routed,
        })
    });
    layer::norm(&model.norm, leaf)
}

/// The gradients of `loss` for `module`'s parameters: its backward pass, then, for every
/// forward pass that was recomputed since the last call, the reruns of its layers (see the
/// module's docs). Without recomputed passes, `GradientsParams::from_grads(loss.backward(),
/// module)`.
pub fn gradients<M: Module>(loss: Tensor<1>, module: &M) -> GradientsParams {
    let mut grads = loss.backward();
    let records = TAPE.with(|t| std::mem::take(&mut *t.borrow_mut()));
    // The load-balancing loss's gradient for the recomputed passes' router sums.
    let routers: Vec<Option<Tensor<1>>> = records
        .iter()
        .map(|r| r.router_leaf.as_ref().and_then(|leaf| leaf.grad(&grads)))
        .collect();
    let outputs: Vec<Option<Tensor<3>>> = records.iter().map(|r| r.leaf.grad_remove(&mut grads)).collect();
    let mut params = GradientsParams::from_grads(grads, module);
    // The generator as the last pass left it, restored once the reruns have reseeded it.
    let last_seeds = records.iter().rev().find_map(|r| r.seeds.clone());
    // Later passes first, as an ordinary backward would meet them; the same order on every
    // rank, so the collectives inside the reruns match.
    for ((record, output), router) in records.into_iter().zip(outputs).zip(routers).rev() {
        // A pass whose output the loss did not use (e.g. sums taken for the loss's
        // normalisation) has nothing to give back, unless its routing entered the loss.
        let output = match (output, &router) {
            (Some(output), _) => output,
            (None, Some(_)) => record.leaf.zeros_like().detach(),
            (None, None) => continue,
        };
        record.backward(output, router, &mut params);
    }
    if let Some(seeds) = last_seeds {
        seeds.after_pass();
    }
    params
}

impl Record {
    /// Reruns the layers from the top with autodiff, adding each one's parameter gradients
    /// to `params`; `grad` is the gradient of the last layer's output, `router` the
    /// load-balancing loss's gradient for each layer's router probability sums.
    fn backward(self, mut grad: Tensor<3>, router: Option<Tensor<1>>, params: &mut GradientsParams) {
        let model = &self.model;
        for (i, (layer, input)) in model.layers.iter().zip(self.inputs).enumerate().rev() {
            let x = input.detach().require_grad();
            let (out, sums) = super::moe::with_valid_tokens_as(self.valid.clone(), || {
                super::moe::capture_router_sums(|| {
                    model.layer_forward(
                        i,
                        x.clone(),
                        (&self.angles, self.local.as_ref()),
                        self.mask.as_ref(),
                        None,
                        self.seeds.as_ref(),
                    )
                })
            });
            let mut seed = (out * grad).sum();
            // (A rerun's input always takes a gradient: its routing is recorded whether or not
            // the pass's entered the loss.)
            if let (Some(sums), Some(router), true) = (sums, &router, self.routed[i]) {
                seed = seed + (sums * router.clone()).sum();
            }
            let mut grads = seed.backward();
            RERUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            grad = x
                .grad_remove(&mut grads)
                .expect("a decoder layer's output depends on its input");
            add_gradients(params, GradientsParams::from_grads(grads, layer), layer);
        }
        let embedded = model.embed(self.tokens);
        // A frozen embedding (LoRA) records nothing to go back through.
        if embedded.is_tracked() {
            let grads = (embedded * grad).sum().backward();
            let embedding = &model.embed_tokens;
            add_gradients(params, GradientsParams::from_grads(grads, embedding), embedding);
        }
    }
}

/// `model` with no parameter tracked by autodiff, its modules' training flags (dropout) as
/// they were: [`Module::freeze`] would also turn dropout off.
fn without_gradients(model: LlamaModel) -> LlamaModel {
    struct Untracked;
    impl burn::module::ModuleMapper for Untracked {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.set_require_grad(false)
        }
    }
    model.map(&mut Untracked)
}

/// Adds `from`'s gradients of `module`'s parameters to those `into` holds.
fn add_gradients<M: Module>(into: &mut GradientsParams, from: GradientsParams, module: &M) {
    struct Add<'a> {
        into: &'a mut GradientsParams,
        from: GradientsParams,
    }
    impl ModuleVisitor for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(grad) = self.from.remove::<D>(param.id) else {
                return;
            };
            let sum = match self.into.remove::<D>(param.id) {
                Some(earlier) => earlier + grad,
                None => grad,
            };
            self.into.register(param.id, sum);
        }
    }
    module.visit(&mut Add { into, from });
}
