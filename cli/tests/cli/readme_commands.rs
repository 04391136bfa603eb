//! Every `omniprefix` command line in the README's shell blocks is one the binary accepts, so a
//! renamed flag or subcommand cannot leave the front page behind.
//!
//! `cli/tests/cli/quickstart.rs` runs the quick start and checks what it prints; this test covers
//! every other command of the README too, by parsing it with the binary's own argument parser
//! (`Cli`, clap), which is what rejects an unknown flag, a missing value or a bad one. A command
//! is a line of a ```sh, ```bash or ```shell block (`\` continues it; a `#` word starts a
//! comment) that runs the binary: `omniprefix ARGS`, a path ending in `/omniprefix` with ARGS,
//! or `cargo run [OPTIONS] -- ARGS`. Other lines (cargo build, pip, bash, python) are not the
//! binary's and are left alone.

use std::path::{Path, PathBuf};

use super::common::TestResult;
use clap::Parser;
use omniprefix_cli::cli::Cli;

/// One command of the README: the line it starts on and the binary's arguments.
#[derive(Debug)]
struct Invocation {
    line: usize,
    args: Vec<String>,
}

fn readme_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")
}

/// The commands of every shell block, each with its first line number (1-based); `Err` names a
/// block that is not closed or a command that ends in `\`.
fn shell_commands(readme: &str) -> Result<Vec<(usize, String)>, String> {
    let mut commands = Vec::new();
    let mut in_shell: Option<bool> = None;
    let mut pending: Option<(usize, String)> = None;
    for (index, line) in readme.lines().enumerate() {
        let number = index + 1;
        if let Some(fence) = line.trim_start().strip_prefix("```") {
            match in_shell {
                None => in_shell = Some(matches!(fence.trim(), "sh" | "bash" | "shell")),
                Some(_) => {
                    if let Some((start, text)) = pending.take() {
                        return Err(format!("README.md:{start}: the command ends in `\\`: {text}"));
                    }
                    in_shell = None;
                }
            }
            continue;
        }
        if in_shell != Some(true) {
            continue;
        }
        let (start, mut text) = pending.take().unwrap_or((number, String::new()));
        let code = without_comment(line);
        match code.trim_end().strip_suffix('\\') {
            Some(head) => {
                text.push_str(head);
                text.push(' ');
                pending = Some((start, text));
            }
            None => {
                text.push_str(code);
                if !text.trim().is_empty() {
                    commands.push((start, text.trim().to_string()));
                }
            }
        }
    }
    if in_shell.is_some() {
        return Err("README.md: a fenced block is not closed".into());
    }
    Ok(commands)
}

/// `line` up to a `#` that starts a word (a shell comment).
fn without_comment(line: &str) -> &str {
    let bytes = line.as_bytes();
    let cut = (0..bytes.len()).find(|&i| bytes[i] == b'#' && (i == 0 || bytes[i - 1].is_ascii_whitespace()));
    cut.map_or(line, |i| &line[..i])
}

/// The binary's arguments (`omniprefix` first) when `command` runs it; `None` when it runs
/// something else. `Err` when it runs the binary through the shell's syntax (a quote, a variable,
/// a pipe or a redirection), which this test would have to guess at: write the plain words.
fn invocation(command: &str) -> Result<Option<Vec<String>>, String> {
    let words: Vec<&str> = command.split_whitespace().collect();
    let rest = match words.as_slice() {
        [program, rest @ ..] if *program == "omniprefix" || program.ends_with("/omniprefix") => rest,
        ["cargo", "run", rest @ ..] => match rest.iter().position(|w| *w == "--") {
            Some(dash) => &rest[dash + 1..],
            None => &[][..],
        },
        _ => return Ok(None),
    };
    if let Some(c) = command.chars().find(|c| "'\"$|;&<>*`(){}".contains(*c)) {
        return Err(format!("`{c}` in a README command needs a shell; write the plain words: {command}"));
    }
    let mut args = vec!["omniprefix".to_string()];
    args.extend(rest.iter().map(|w| w.to_string()));
    Ok(Some(args))
}

/// Every command of `readme` that runs the binary.
fn invocations(readme: &str) -> Result<Vec<Invocation>, String> {
    let mut found = Vec::new();
    for (line, command) in shell_commands(readme)? {
        if let Some(args) = invocation(&command).map_err(|why| format!("README.md:{line}: {why}"))? {
            found.push(Invocation { line, args });
        }
    }
    Ok(found)
}

/// Parses each invocation as the binary does; one line per command it rejects, with clap's reason.
fn rejected(invocations: &[Invocation]) -> Vec<String> {
    invocations
        .iter()
        .filter_map(|inv| {
            Cli::try_parse_from(&inv.args).err().map(|e| {
                let why = e.to_string();
                let first = why.lines().next().unwrap_or("").to_string();
                format!("README.md:{}: `{}`: {first}", inv.line, inv.args.join(" "))
            })
        })
        .collect()
}

#[test]
fn every_readme_command_parses() -> TestResult {
    let readme = std::fs::read_to_string(readme_path())?;
    let found = invocations(&readme)?;
    // The demo (`cargo run --release -- demo`) and the quick start's four commands at least: a
    // parser that found none would pass anything.
    assert!(found.len() >= 5, "too few README commands found: {found:?}");
    assert!(found.iter().any(|inv| inv.args.get(1).map(String::as_str) == Some("demo")), "{found:?}");
    let bad = rejected(&found);
    assert!(bad.is_empty(), "README commands the binary rejects:\n{}", bad.join("\n"));
    Ok(())
}

/// The scripts the README's commands run with `bash SCRIPT` that are not in the repository.
fn missing_scripts(readme: &str, root: &Path) -> Result<Vec<String>, String> {
    Ok(shell_commands(readme)?
        .into_iter()
        .filter_map(|(line, command)| {
            let script = command.split_whitespace().skip_while(|w| *w != "bash").nth(1)?.to_string();
            (!root.join(&script).is_file()).then(|| format!("README.md:{line}: no {script}"))
        })
        .collect())
}

#[test]
fn every_script_the_readme_runs_exists() -> TestResult {
    let readme = std::fs::read_to_string(readme_path())?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    assert_eq!(missing_scripts(&readme, &root)?, Vec::<String>::new());
    let planted = readme.replacen("bash scripts/test.sh", "bash scripts/tests.sh", 1);
    assert_eq!(missing_scripts(&planted, &root)?.len(), 1, "a renamed script must be caught");
    Ok(())
}

#[test]
fn a_drifted_readme_command_fails() -> TestResult {
    let readme = std::fs::read_to_string(readme_path())?;

    // A misspelled flag, a misspelled subcommand and a flag that lost its value are each rejected.
    for (from, to) in
        [("--max-tokens 8", "--max-token 8"), ("-- demo", "-- demoo"), ("--warm ", "--warm --warm ")]
    {
        assert!(readme.contains(from), "the README no longer holds `{from}`: update this plant");
        let planted = readme.replacen(from, to, 1);
        assert!(!rejected(&invocations(&planted)?).is_empty(), "planting `{to}` must fail");
    }

    // A command behind shell syntax is refused, not guessed at; other programs are not ours.
    assert!(invocation("omniprefix hidden --out $OUT").is_err());
    assert!(invocation("cargo run --release -- demo > out.txt").is_err());
    assert_eq!(invocation("cargo build --release")?, None);
    assert_eq!(invocation("bash scripts/test.sh")?, None);
    assert_eq!(
        invocation("target/release/omniprefix demo --quick")?,
        Some(vec!["omniprefix".into(), "demo".into(), "--quick".into()])
    );

    // Continuations join, comments go, and only shell blocks count.
    let text = "```sh\nomniprefix demo \\\n    --quick   # fast\n```\n```text\nomniprefix nonsense\n```\n";
    let found = invocations(text)?;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!((found[0].line, found[0].args.join(" ")), (2, "omniprefix demo --quick".to_string()));
    assert!(rejected(&found).is_empty());
    assert!(shell_commands("```sh\nomniprefix demo \\\n```\n").is_err());
    assert!(shell_commands("```sh\nomniprefix demo\n").is_err());
    Ok(())
}
