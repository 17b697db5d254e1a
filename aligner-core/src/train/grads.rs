//! Global gradient-norm clipping across every parameter, as `torch.nn.utils.clip_grad_norm_`.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    parts: Vec<Tensor<1>>,
}

impl ModuleVisitor for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.get::<D>(param.id) {
            self.parts.push(g.square().sum());
        }
    }
}

struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
}

impl ModuleVisitor for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.remove::<D>(param.id) {
            self.grads.register::<D>(param.id, g.mul_scalar(self.factor));
        }
    }
}

/// The L2 norm of all gradients of `module`'s parameters.
pub fn global_grad_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    let mut visitor = SquaredNorm {
        grads,
        parts: Vec::new(),
    };
    module.visit(&mut visitor);
    if visitor.parts.is_empty() {
        return 0.0;
    }
    let total: f32 = Tensor::cat(visitor.parts, 0).sum().sqrt().into_scalar::<f32>();
    total as f64
}

/// Scales all gradients so their global norm is at most `max_norm` (no-op for `max_norm <= 0`).
/// Returns the norm before clipping.
pub fn clip_grad_norm<M: Module>(module: &M, grads: &mut GradientsParams, max_norm: f64) -> f64 {
    let norm = global_grad_norm(module, grads);
    if max_norm > 0.0 && norm > max_norm {
        let mut scale = Scale {
            grads,
            factor: max_norm / (norm + 1e-6),
        };
        module.visit(&mut scale);
    }
    norm
}
