//! Data-parallel helpers on top of [`aligner_parallel::Communicator`]: values every rank must
//! share, work split over ranks and gathered back in order.

use std::ops::Range;
use std::time::Instant;

use aligner_parallel::{Communicator, shard_range};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{CoreError, Result};

/// The process group this program was launched in (one process unless started by `mpirun`
/// in a build with the `mpi` feature).
pub fn world() -> std::sync::Arc<dyn Communicator> {
    aligner_parallel::world()
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| CoreError::Invalid(format!("data-parallel message: {e}")))
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| CoreError::Invalid(format!("data-parallel message: {e}")))
}

/// Rank 0's `value` on every rank.
pub fn broadcast_from_root<T: Serialize + DeserializeOwned>(comm: &dyn Communicator, value: &T) -> Result<T> {
    let mut bytes = encode(value)?;
    if comm.world_size() == 1 {
        return decode(&bytes);
    }
    comm.broadcast(&mut bytes, 0)?;
    decode(&bytes)
}

/// Every rank's `value`, in rank order.
pub fn gather<T: Serialize + DeserializeOwned>(comm: &dyn Communicator, value: &T) -> Result<Vec<T>> {
    comm.all_gather(&encode(value)?)?
        .iter()
        .map(|bytes| decode(bytes))
        .collect()
}

/// `f` over `items` split into contiguous shards, one per rank; the results of all ranks, in
/// item order, on every rank. With one process `f` sees every item at once.
pub fn map_sharded<I, T, E>(
    comm: &dyn Communicator,
    items: &[I],
    f: impl FnOnce(&[I]) -> std::result::Result<Vec<T>, E>,
) -> std::result::Result<Vec<T>, E>
where
    T: Serialize + DeserializeOwned,
    E: From<CoreError>,
{
    if comm.world_size() == 1 {
        return f(items);
    }
    let mine = &items[shard_range(items.len(), comm.rank(), comm.world_size())];
    let out = f(mine)?;
    Ok(gather(comm, &out)?.into_iter().flatten().collect())
}

/// How a rank spent a balanced map: the items it took and the seconds it worked on them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct RankWork {
    pub items: usize,
    pub seconds: f64,
}

/// `f` over `0..items`, handed out `chunk` at a time to whichever rank asks first (a rank whose
/// work comes out quicker takes more), the results of all ranks in item order on every rank,
/// and each rank's share of the work.
pub fn map_balanced<T, E>(
    comm: &dyn Communicator,
    items: usize,
    chunk: usize,
    mut f: impl FnMut(Range<usize>) -> std::result::Result<Vec<T>, E>,
) -> std::result::Result<(Vec<T>, Vec<RankWork>), E>
where
    T: Serialize + DeserializeOwned,
    E: From<CoreError>,
{
    if comm.world_size() == 1 {
        let started = Instant::now();
        let out = f(0..items)?;
        let work = RankWork {
            items,
            seconds: started.elapsed().as_secs_f64(),
        };
        return Ok((out, vec![work]));
    }
    let mut queue = comm.work_queue(items, chunk).map_err(CoreError::from)?;
    let mut mine: Vec<(usize, Vec<T>)> = Vec::new();
    let mut failure = None;
    let mut busy = 0.0;
    // Drain the queue even after a failure, so no rank waits on this one.
    while let Some(range) = queue.next_chunk().map_err(CoreError::from)? {
        if failure.is_none() {
            let started = Instant::now();
            match f(range.clone()) {
                Ok(out) => mine.push((range.start, out)),
                Err(e) => failure = Some(e),
            }
            busy += started.elapsed().as_secs_f64();
        }
    }
    drop(queue);
    let work = RankWork {
        items: mine.iter().map(|(_, v)| v.len()).sum(),
        seconds: busy,
    };
    let failed = gather(comm, &failure.is_some())?;
    if let Some(e) = failure {
        return Err(e);
    }
    if let Some(rank) = failed.iter().position(|&f| f) {
        return Err(CoreError::Invalid(format!("rank {rank} failed (see its log)")).into());
    }
    let gathered = gather(comm, &(work, mine))?;
    let works = gathered.iter().map(|(w, _)| *w).collect();
    let mut pieces: Vec<(usize, Vec<T>)> = gathered.into_iter().flat_map(|(_, m)| m).collect();
    pieces.sort_by_key(|(start, _)| *start);
    Ok((pieces.into_iter().flat_map(|(_, v)| v).collect(), works))
}
