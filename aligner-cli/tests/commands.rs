//! The binary's command list. (The end-to-end tests of every command are the other files in
//! this folder.)

use std::process::Command;

#[test]
fn help_lists_every_command() {
    let out = Command::new(env!("CARGO_BIN_EXE_aligner"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for command in [
        "sft", "rm", "dpo", "kto", "ppo", "steerlm", "spin", "rs", "serve", "generate", "score", "convert",
        "bench",
    ] {
        assert!(
            help.lines()
                .any(|l| l.trim_start().starts_with(&format!("{command} "))),
            "{command} missing from:\n{help}"
        );
    }
}
