//! Where a command may write: never over one of its own inputs, never into a model or run
//! folder, and over an earlier result only when `--overwrite` says so.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// The absolute form of `path`, with its existing part resolved (symlinks, `..`), so that two
/// spellings of one file compare equal even when the file does not exist yet.
fn resolved(path: &Path) -> PathBuf {
    if let Ok(real) = path.canonicalize() {
        return real;
    }
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    match (absolute.parent(), absolute.file_name()) {
        (Some(parent), Some(name)) => resolved(parent).join(name),
        _ => absolute,
    }
}

/// Checks that the command may write the file `out` (given as `flag`): refused when it is one
/// of `inputs` (files, or folders whose files the command reads) or a folder; a file that
/// exists, or a new one straight inside a model or run folder, only with `overwrite`.
pub fn check_file(flag: &str, out: &Path, inputs: &[&Path], overwrite: bool) -> Result<()> {
    let target = resolved(out);
    for input in inputs {
        let input = resolved(input);
        if target == input {
            bail!(
                "{flag} {}: that is an input of this command; write somewhere else",
                out.display()
            );
        }
        if target.starts_with(&input) {
            bail!(
                "{flag} {}: that is inside {}, an input of this command; write somewhere else",
                out.display(),
                input.display()
            );
        }
    }
    if out.is_dir() {
        bail!("{flag} {}: that is a folder; give a file name", out.display());
    }
    if overwrite {
        return Ok(());
    }
    if out.exists() {
        bail!(
            "{flag} {}: the file exists; pass --overwrite to replace it",
            out.display()
        );
    }
    if let Some((folder, what)) = target.parent().and_then(|d| guarded(d).map(|w| (d, w))) {
        bail!(
            "{flag} {}: {} is {what}, whose files other commands read; write somewhere else \
             (or pass --overwrite to write into it)",
            out.display(),
            folder.display()
        );
    }
    Ok(())
}

/// Checks that the command may write `files` into the folder `out` (given as `flag`), each as
/// [`check_file`] does.
pub fn check_folder(flag: &str, out: &Path, files: &[&str], inputs: &[&Path], overwrite: bool) -> Result<()> {
    if out.exists() && !out.is_dir() {
        bail!("{flag} {}: that is a file; give a folder", out.display());
    }
    for file in files {
        check_file(flag, &out.join(file), inputs, overwrite)?;
    }
    Ok(())
}

/// What `dir` is when it is a folder no command's output may go into: a model folder or a
/// training run's folder.
fn guarded(dir: &Path) -> Option<&'static str> {
    if dir.join("config.json").is_file() {
        Some("a model folder")
    } else if dir.join("metrics.jsonl").is_file() || dir.join("config.toml").is_file() {
        Some("a run folder")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_keep_off_inputs_model_and_run_folders_and_earlier_results() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let data = root.join("data.jsonl");
        std::fs::write(&data, "{}\n").unwrap();
        let model = root.join("model");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(model.join("config.json"), "{}").unwrap();
        let run = root.join("run");
        std::fs::create_dir(&run).unwrap();
        std::fs::write(run.join("metrics.jsonl"), "").unwrap();

        let err = |r: Result<()>| r.unwrap_err().to_string();
        // One of the inputs, however it is spelled, or inside an input folder: never.
        let spelled = root.join("model/../data.jsonl");
        assert!(err(check_file("--out", &spelled, &[&data], true)).contains("an input"));
        assert!(err(check_file("--out", &model.join("x.jsonl"), &[&model], true)).contains("inside"));
        // A folder where a file is meant, and the other way round.
        assert!(err(check_file("--out", root, &[], true)).contains("a folder"));
        assert!(err(check_folder("--out", &data, &["a"], &[], true)).contains("a file"));
        // Straight inside a model or run folder, or over an earlier result: only when asked.
        assert!(err(check_file("--out", &model.join("x.jsonl"), &[], false)).contains("a model folder"));
        assert!(err(check_folder("--out", &run, &["summary.json"], &[], false)).contains("a run folder"));
        check_file("--out", &run.join("x.svg"), &[], true).unwrap();
        let earlier = root.join("out.jsonl");
        std::fs::write(&earlier, "").unwrap();
        assert!(err(check_file("--out", &earlier, &[&data], false)).contains("--overwrite"));
        check_file("--out", &earlier, &[&data], true).unwrap();
        // New files elsewhere, a run's subfolder included, need nothing.
        check_file("--out", &root.join("new/out.jsonl"), &[&data], false).unwrap();
        check_folder("--out", &run.join("eval"), &["summary.json"], &[&data], false).unwrap();
        std::fs::create_dir(root.join("eval")).unwrap();
        std::fs::write(root.join("eval/summary.json"), "").unwrap();
        let again = check_folder("--out", &root.join("eval"), &["summary.json"], &[], false);
        assert!(err(again).contains("--overwrite"));
    }
}
