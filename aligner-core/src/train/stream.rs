//! Saving a model the ranks hold in parts (`train.sharding = "full"`'s rows, a tensor group's
//! blocks) without gathering it whole anywhere: the writer saves as one process would, and
//! each parameter held in parts is gathered to it as the file reaches that parameter, while
//! the other ranks answer its requests ([`SaveParts::serve`]). The writer holds one whole
//! parameter at a time, the others their parts and nothing more.
//!
//! The writer names each parameter it needs by id in a broadcast, so the ranks follow the
//! file's order whatever it is; an empty request ends the save.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use aligner_parallel::Communicator;
use aligner_parallel::shard::{spec_of, whole_id};
use aligner_parallel::tensor::split_of;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;

use crate::checkpoint::{PartsSource, with_parts_source};
use crate::error::{CoreError, Result};
use crate::run::RunDir;

/// How the ranks hold the model's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parts {
    /// Each rank its rows (`full` sharding).
    Rows,
    /// Each rank of a tensor group its block.
    Blocks,
}

impl Parts {
    /// The whole shape and whole id of parameter `id` when this rank's tensor of shape `dims`
    /// is a part of it.
    fn whole_of(self, id: u64, dims: &[usize]) -> Option<(Vec<usize>, u64)> {
        match self {
            Parts::Rows => spec_of(id, dims).map(|spec| (spec.dims, whole_id(id))),
            Parts::Blocks => split_of(id, dims).map(|split| (split.dims, id)),
        }
    }

    /// Sends this rank's part `own` of parameter `id` to rank 0 of the ranks holding it; the
    /// whole values there.
    fn gather_to_root(self, id: u64, dims: &[usize], own: &[f32]) -> Option<Vec<f32>> {
        match self {
            Parts::Rows => spec_of(id, dims).and_then(|spec| spec.gather_values_to(own, 0)),
            Parts::Blocks => split_of(id, dims).and_then(|split| split.gather_values_to(own, 0)),
        }
    }
}

impl Parts {
    /// `model` with its parts gathered whole on rank 0 of the ranks holding them (`None` on
    /// the others, which send their parts and keep nothing).
    fn gather_model_to_root<M: Module>(self, model: &M) -> Option<M> {
        match self {
            Parts::Rows => super::full::gather_parameters_to_root(model),
            Parts::Blocks => super::tensor::gather_parameters_to_root(model),
        }
    }
}

/// This rank's part in saving a model held in parts.
pub(crate) enum SaveParts {
    /// The model is whole on every rank: the writer saves it, the others take no part.
    Whole,
    /// This rank writes; the ranks of `comm` send it their parts on request.
    Writer {
        comm: Arc<dyn Communicator>,
        parts: Parts,
    },
    /// This rank answers the writer's requests (rank 0 of `comm`).
    Server {
        comm: Arc<dyn Communicator>,
        parts: Parts,
    },
    /// A tensor group other than the writer's: it holds the same blocks as the writer's group
    /// and takes no part.
    Idle,
}

impl SaveParts {
    /// The part of this rank of `run` in a save of the model as it holds it: fully sharded
    /// (`full`), split over a tensor group (`split`) or whole.
    pub(crate) fn of(run: &RunDir, full: bool, split: bool) -> Self {
        if full {
            let comm = run.comm_handle();
            return match comm.rank() {
                0 => SaveParts::Writer {
                    comm,
                    parts: Parts::Rows,
                },
                _ => SaveParts::Server {
                    comm,
                    parts: Parts::Rows,
                },
            };
        }
        match run.tensor_group().filter(|_| split) {
            // The writer (world rank 0) is rank 0 of the first group, the data rank 0.
            Some(group) if run.comm().rank() == 0 => match group.rank() {
                0 => SaveParts::Writer {
                    comm: group,
                    parts: Parts::Blocks,
                },
                _ => SaveParts::Server {
                    comm: group,
                    parts: Parts::Blocks,
                },
            },
            Some(_) => SaveParts::Idle,
            None => SaveParts::Whole,
        }
    }

    /// Runs `save` on the writer, with the parameters held in parts gathered as it reads
    /// them; the ranks serving it answer meanwhile ([`SaveParts::serve`]), so every rank of
    /// the save must call this or `serve`. The save ends (the serving ranks are released)
    /// whether `save` succeeds or not.
    fn write<R>(&self, save: impl FnOnce() -> R) -> Result<R> {
        let SaveParts::Writer { comm, parts } = self else {
            return Ok(save());
        };
        let source = Rc::new(ToWriter {
            comm: comm.clone(),
            parts: *parts,
        });
        let saved = with_parts_source(source, save);
        // The empty request: the save is over.
        comm.broadcast(&mut Vec::new(), 0)?;
        Ok(saved)
    }

    /// On a rank holding parts of `model` for the writer: sends it the part of each parameter
    /// it asks for, until the save ends. Nothing on the other ranks.
    fn serve<M: Module>(&self, model: &M) -> Result<()> {
        let SaveParts::Server { comm, parts } = self else {
            return Ok(());
        };
        let held = held_parts(model, *parts);
        loop {
            let mut request = Vec::new();
            comm.broadcast(&mut request, 0)?;
            let Ok(id) = <[u8; 8]>::try_from(request.as_slice()) else {
                return Ok(());
            };
            let id = u64::from_le_bytes(id);
            let Some(part) = held.get(&id) else {
                return Err(CoreError::Invalid(format!(
                    "saving a model held in parts: the writer asked for parameter {id}, which this \
                     rank does not hold a part of"
                )));
            };
            parts.gather_to_root(id, &part.dims, &(part.values)());
        }
    }

    /// On the writer: `save` of `model`, whose parameters held in parts are gathered as the
    /// save reads them where the store `reads_parameters` (see
    /// [`crate::store::ModelStore::reads_parameters`]), else gathered whole to the writer
    /// first. The ranks holding the other parts call [`SaveParts::help_save`] meanwhile.
    pub(crate) fn save_on_writer<M: Module, E: From<CoreError>>(
        &self,
        model: &M,
        reads_parameters: bool,
        save: impl FnOnce(&M) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        match self {
            SaveParts::Writer { parts, .. } if !reads_parameters => {
                let whole = parts.gather_model_to_root(model).ok_or_else(|| {
                    CoreError::Invalid("saving a model held in parts: rank 0 received no whole model".into())
                })?;
                save(&whole)
            }
            SaveParts::Writer { .. } => self.write(|| save(model))?,
            _ => save(model),
        }
    }

    /// On the ranks other than the writer: their part in [`SaveParts::save_on_writer`].
    pub(crate) fn help_save<M: Module>(&self, model: &M, reads_parameters: bool) -> Result<()> {
        match self {
            SaveParts::Server { parts, .. } if !reads_parameters => {
                parts.gather_model_to_root(model);
                Ok(())
            }
            SaveParts::Server { .. } => self.serve(model),
            _ => Ok(()),
        }
    }

    /// `model` whole on the writer alone (`None` on the other ranks): gathered from the ranks'
    /// parts, which the ranks holding them send (a collective for them), or the model itself
    /// where it is whole. What the writer alone computes on (the frontier's samples).
    pub(crate) fn whole_on_writer<'m, M: Module>(
        &self,
        model: &'m M,
        run: &RunDir,
    ) -> Option<std::borrow::Cow<'m, M>> {
        match self {
            SaveParts::Writer { parts, .. } | SaveParts::Server { parts, .. } => {
                parts.gather_model_to_root(model).map(std::borrow::Cow::Owned)
            }
            SaveParts::Whole => run.is_writer().then_some(std::borrow::Cow::Borrowed(model)),
            SaveParts::Idle => None,
        }
    }

    /// Whether this rank writes the save.
    pub(crate) fn writes(&self, run: &RunDir) -> bool {
        match self {
            SaveParts::Writer { .. } => true,
            SaveParts::Whole => run.is_writer(),
            SaveParts::Server { .. } | SaveParts::Idle => false,
        }
    }
}

/// The writer's side: each parameter held in parts is requested by id, then gathered.
struct ToWriter {
    comm: Arc<dyn Communicator>,
    parts: Parts,
}

impl PartsSource for ToWriter {
    fn whole_of(&self, id: u64, dims: &[usize]) -> Option<(Vec<usize>, u64)> {
        self.parts.whole_of(id, dims)
    }

    fn gather(&self, id: u64, dims: &[usize], own: &[f32]) -> Vec<f32> {
        self.comm
            .broadcast(&mut id.to_le_bytes().to_vec(), 0)
            .unwrap_or_else(|e| panic!("asking the ranks for parameter {id}: {e}"));
        self.parts
            .gather_to_root(id, dims, own)
            .unwrap_or_else(|| panic!("parameter {id} of shape {dims:?} is not held in parts"))
    }
}

/// A part of a parameter a rank holds: its shape and its values when asked.
struct HeldPart {
    dims: Vec<usize>,
    values: Box<dyn Fn() -> Vec<f32>>,
}

/// The parts of `model`'s parameters this rank holds, by id.
fn held_parts<M: Module>(model: &M, parts: Parts) -> HashMap<u64, HeldPart> {
    struct Collect {
        parts: Parts,
        held: HashMap<u64, HeldPart>,
    }
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            let dims = tensor.dims().to_vec();
            if self.parts.whole_of(param.id.val(), &dims).is_none() {
                return;
            }
            let values = Box::new(move || super::full::host_values(tensor.clone()));
            self.held.insert(param.id.val(), HeldPart { dims, values });
        }
    }
    let mut collect = Collect {
        parts,
        held: HashMap::new(),
    };
    model.visit(&mut collect);
    collect.held
}
