//! Files a run computes once and reads back when it resumes (reference log-probs, SPIN's
//! answers, SteerLM's bootstrap samples), each tied to what it was computed from: a SHA-256
//! [`CacheKey`] of the model weights, the data and the settings, kept next to the file as
//! `<file>.key`. A cache whose key differs (other weights, changed data) is computed again.

use std::path::{Path, PathBuf};

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::error::{CoreError, Result};
use crate::model::CausalLm;

/// What a cached file was computed from, as a hex SHA-256.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKey(String);

impl CacheKey {
    /// Starts a key; feed it everything the cached values depend on.
    pub fn builder(purpose: &str) -> CacheKeyBuilder {
        let mut hasher = Sha256::new();
        hasher.update(purpose.as_bytes());
        CacheKeyBuilder { hasher }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Hashes the inputs of a cache, each framed by its length so no two inputs run together.
pub struct CacheKeyBuilder {
    hasher: Sha256,
}

impl CacheKeyBuilder {
    fn bytes(mut self, bytes: &[u8]) -> Self {
        self.hasher.update((bytes.len() as u64).to_le_bytes());
        self.hasher.update(bytes);
        self
    }

    /// The weights `model` computes with (adapters folded in): names, shapes and values.
    pub fn weights(mut self, model: &CausalLm) -> Self {
        for (name, shape, values) in crate::checkpoint::hf_tensors(&model.merged()) {
            self = self.bytes(name.as_bytes());
            let dims: Vec<u8> = shape.iter().flat_map(|d| (*d as u64).to_le_bytes()).collect();
            self = self.bytes(&dims);
            let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            self = self.bytes(&raw);
        }
        self
    }

    /// Every file of a model folder, by name, in name order (weights, config, tokenizer).
    pub fn folder(mut self, dir: &Path) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| CoreError::io(dir, e))?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        for file in files {
            let data = std::fs::read(&file).map_err(|e| CoreError::io(&file, e))?;
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            self = self.bytes(name.as_bytes()).bytes(&data);
        }
        Ok(self)
    }

    /// The bytes of a file (a data file as given).
    pub fn file(self, path: &Path) -> Result<Self> {
        let data = std::fs::read(path).map_err(|e| CoreError::io(path, e))?;
        Ok(self.bytes(&data))
    }

    /// A value (rows of data, settings) as its JSON.
    pub fn value<T: Serialize + ?Sized>(self, value: &T) -> Self {
        let json = serde_json::to_vec(value).unwrap_or_else(|e| e.to_string().into_bytes());
        self.bytes(&json)
    }

    pub fn finish(self) -> CacheKey {
        let digest = self.hasher.finalize();
        CacheKey(digest.iter().map(|b| format!("{b:02x}")).collect())
    }
}

/// `<file>.key`: where the key of `file` is kept.
pub fn key_path(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".key");
    PathBuf::from(name)
}

/// The text of `file` when its key is `key`; `None` when it is missing or was computed from
/// something else (logged).
pub fn read_fresh(file: &Path, key: &CacheKey) -> Option<String> {
    if !is_fresh(file, key) {
        return None;
    }
    std::fs::read_to_string(file).ok()
}

/// Whether `file` exists and was computed under `key` (a stale one is logged).
pub fn is_fresh(file: &Path, key: &CacheKey) -> bool {
    if !file.exists() {
        return false;
    }
    let kept = std::fs::read_to_string(key_path(file)).ok();
    if kept.as_deref().map(str::trim) != Some(key.as_str()) {
        tracing::info!(cache = %file.display(), "cache computed from other weights, data or settings; computing it again");
        return false;
    }
    true
}

/// Writes `text` to `file` and then its key, each atomically ([`write_with`]).
pub fn write(file: &Path, key: &CacheKey, text: &str) -> Result<()> {
    write_with(file, key, |path| {
        crate::checkpoint::write_atomic(path, text.as_bytes())
    })
}

/// Writes `file` with `write_file` and then its key: the old key goes first, so a run killed
/// in between leaves a file without a key (computed again), never a stale pair.
pub fn write_with<E: From<CoreError>>(
    file: &Path,
    key: &CacheKey,
    write_file: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let key_file = key_path(file);
    match std::fs::remove_file(&key_file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(CoreError::cannot_write(&key_file, e).into());
        }
        _ => {}
    }
    write_file(file)?;
    Ok(crate::checkpoint::write_atomic(
        &key_file,
        format!("{}\n", key.as_str()).as_bytes(),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_is_read_back_only_under_its_own_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("reference_train.jsonl");
        let key = |rows: &[&str]| CacheKey::builder("test").value(rows).finish();
        let (a, b) = (key(&["x", "y"]), key(&["y", "x"]));
        assert_ne!(a, b, "the order of the data is part of the key");
        assert_ne!(key(&["xy"]), key(&["x", "y"]), "inputs are framed");
        assert_eq!(read_fresh(&file, &a), None);
        write(&file, &a, "1\n2\n").unwrap();
        assert_eq!(read_fresh(&file, &a).as_deref(), Some("1\n2\n"));
        assert_eq!(read_fresh(&file, &b), None);
        // A file without its key (an older run, or killed before the key) is not trusted.
        std::fs::remove_file(key_path(&file)).unwrap();
        assert_eq!(read_fresh(&file, &a), None);
    }

    #[test]
    fn the_key_of_a_model_changes_with_any_weight() {
        let device = crate::Device::flex();
        let lm = crate::LoadedModel::from_dir(&crate::default_model_dir().unwrap(), &device).unwrap();
        let key = |model: &CausalLm| CacheKey::builder("w").weights(model).finish();
        let before = key(&lm.model);
        assert_eq!(before, key(&lm.model.clone()));
        let mut changed = lm.model.clone();
        let norm = &mut changed.model.norm;
        let bumped = norm.gamma.val().add_scalar(1e-3);
        norm.gamma = norm.gamma.clone().map(|_| bumped);
        assert_ne!(before, key(&changed));
    }
}
