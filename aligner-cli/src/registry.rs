//! The preference losses of this build: the built-in DPO family and every variant crate
//! compiled in by its cargo feature. `aligner dpo`, `aligner spin` and `aligner bench` all use
//! this one registry.

use aligner_dpo::LossRegistry;

/// Every compiled-in loss, by name.
pub fn registry() -> LossRegistry {
    #[allow(unused_mut)] // variant crates register only when their feature is on
    let mut registry = LossRegistry::with_builtin();
    #[cfg(feature = "simpo")]
    aligner_simpo::register(&mut registry);
    registry
}
