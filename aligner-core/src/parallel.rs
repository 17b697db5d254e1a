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

/// Stops every rank with one error naming the first key that differs when the ranks of a
/// data-parallel run were not given the same run (different `--set`s per rank, a config or
/// data file that differs between nodes): compared are every resolved setting and the
/// contents of each file a setting names.
pub fn check_same_config<T: Serialize>(comm: &dyn Communicator, config: &T) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let all = gather(comm, &fingerprint(config)?)?;
    for (rank, other) in all.iter().enumerate().skip(1) {
        let keys = all[0].keys().chain(other.keys());
        if let Some(key) = keys.filter(|k| all[0].get(*k) != other.get(*k)).min() {
            let value = |m: &Fingerprint| m.get(key).cloned().unwrap_or_else(|| "not set".into());
            return Err(CoreError::Invalid(format!(
                "rank {rank} was given another run than rank 0: `{key}` is {} on rank 0 and {} on \
                 rank {rank}; every rank must run the same command with the same files",
                value(&all[0]),
                value(other)
            )));
        }
    }
    Ok(())
}

/// A configuration as dotted keys and their values, a file's size and CRC-32C beside each
/// value that names one.
type Fingerprint = std::collections::BTreeMap<String, String>;

fn fingerprint<T: Serialize>(config: &T) -> Result<Fingerprint> {
    fn flatten(prefix: &str, value: &toml::Value, out: &mut Fingerprint) {
        match value {
            toml::Value::Table(table) => {
                for (k, v) in table {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    flatten(&key, v, out);
                }
            }
            toml::Value::String(text) if !text.is_empty() && std::path::Path::new(text).is_file() => {
                let contents = std::fs::read(text)
                    .map(|b| format!("{} bytes, CRC-32C {:08x}", b.len(), crc32c::crc32c(&b)))
                    .unwrap_or_else(|e| format!("unreadable: {e}"));
                out.insert(prefix.to_string(), format!("{value} (a file of {contents})"));
            }
            other => {
                out.insert(prefix.to_string(), other.to_string());
            }
        }
    }
    let table: toml::Table = toml::from_str(&crate::train::config::to_toml(config)?)
        .map_err(|e| CoreError::Invalid(format!("configuration: {e}")))?;
    let mut out = Fingerprint::new();
    flatten("", &toml::Value::Table(table), &mut out);
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fingerprint_names_each_setting_and_what_its_files_hold() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("train.jsonl");
        std::fs::write(&data, "{}\n").unwrap();
        let mut config = toml::Table::new();
        let mut train = toml::Table::new();
        train.insert("lr".into(), 0.001.into());
        train.insert("data".into(), data.to_str().unwrap().into());
        config.insert("train".into(), train.into());
        let before = fingerprint(&config).unwrap();
        assert_eq!(before["train.lr"], "0.001");
        assert!(before["train.data"].contains("3 bytes"), "{before:?}");
        // The same path with other contents (a node's own copy of the file) differs.
        std::fs::write(&data, "{}\n").unwrap();
        assert_eq!(fingerprint(&config).unwrap(), before);
        std::fs::write(&data, "[]\n").unwrap();
        assert_ne!(fingerprint(&config).unwrap()["train.data"], before["train.data"]);
        // One process has nothing to compare with.
        check_same_config(&aligner_parallel::Single, &config).unwrap();
    }
}
