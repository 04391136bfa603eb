//! Every command of the README's quick start runs as written, from the repository root, and prints
//! what the README says it prints, so the front page cannot drift from the binary.
//!
//! The quick start is the README's `## Quick start` section: its first fenced block (`sh`) holds
//! the commands, one per line (`\` continues a line), and each command's output follows as a `text`
//! block, in the same order. An output line that is a JSON object must match the printed JSON on
//! every key it shows (timings, keys ending in `_ms`, `_ms_median` or `_per_s`, only need to be
//! numbers); any other line must be printed as it stands, the lines in the README's order. An
//! argument under `/tmp/` is redirected to a scratch folder of this test.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::common::{self, TestResult};
use serde_json::Value;

/// One command of the quick start and the lines the README shows for it.
#[derive(Debug)]
struct Step {
    args: Vec<String>,
    expected: Vec<String>,
}

fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn readme() -> TestResult<String> {
    Ok(std::fs::read_to_string(repository_root().join("README.md"))?)
}

/// The text of the `## Quick start` section, up to the next `## ` heading.
fn quick_start(readme: &str) -> Result<&str, String> {
    let start = readme.find("\n## Quick start\n").ok_or("the README has no `## Quick start` section")?;
    let section = &readme[start + 1..];
    let end = section[3..].find("\n## ").map_or(section.len(), |i| i + 3);
    Ok(&section[..end])
}

/// The fenced blocks of `text` in order: (language, body).
fn fenced_blocks(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut blocks = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(language) = line.strip_prefix("```") else { continue };
        let mut body = Vec::new();
        loop {
            match lines.next() {
                Some("```") => break,
                Some(inner) => body.push(inner),
                None => return Err(format!("a ```{language} block is not closed")),
            }
        }
        blocks.push((language.trim().to_string(), body.join("\n")));
    }
    Ok(blocks)
}

/// The commands of an `sh` block as argument lists, each starting with `omniprefix`. The test runs
/// the words, not a shell, so a quote, a variable, a pipe or a redirection is refused.
fn commands(sh: &str) -> Result<Vec<Vec<String>>, String> {
    let mut commands = Vec::new();
    let mut pending = String::new();
    for line in sh.lines() {
        let line = line.trim();
        if pending.is_empty() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(line);
        if let Some(c) = pending.chars().find(|c| "'\"$|;&<>*`(){}".contains(*c)) {
            return Err(format!(
                "`{c}` in a quick-start command needs a shell, which this test does not run: {pending}"
            ));
        }
        let args: Vec<String> = pending.split_whitespace().map(str::to_string).collect();
        if args.first().map(String::as_str) != Some("omniprefix") {
            return Err(format!("a quick-start command that is not `omniprefix ...`: {pending}"));
        }
        commands.push(args);
        pending.clear();
    }
    if !pending.is_empty() {
        return Err(format!("the last quick-start command ends in `\\`: {pending}"));
    }
    Ok(commands)
}

/// The quick start as commands, each with the output lines the README shows for it.
fn steps(readme: &str) -> Result<Vec<Step>, String> {
    let blocks = fenced_blocks(quick_start(readme)?)?;
    let Some(((language, sh), outputs)) = blocks.split_first() else {
        return Err("the quick start holds no fenced block".into());
    };
    if language != "sh" {
        return Err(format!(
            "the quick start's first block is ```{language}, not the ```sh block of its commands"
        ));
    }
    if let Some((other, _)) = outputs.iter().find(|(language, _)| language != "text") {
        return Err(format!(
            "a ```{other} block after the commands: only ```text blocks of their output may follow"
        ));
    }
    let commands = commands(sh)?;
    if commands.is_empty() || commands.len() != outputs.len() {
        return Err(format!(
            "{} quick-start commands but {} ```text blocks of output",
            commands.len(),
            outputs.len()
        ));
    }
    Ok(commands
        .into_iter()
        .zip(outputs)
        .map(|(args, (_, text))| Step { args, expected: text.lines().map(str::to_string).collect() })
        .collect())
}

/// Runs a step's command with the binary under test, `/tmp/...` arguments redirected to `scratch`;
/// its stdout, or why it failed.
fn run(step: &Step, scratch: &Path) -> TestResult<String> {
    let args = step.args[1..].iter().map(|arg| match arg.strip_prefix("/tmp/") {
        Some(name) => scratch.join(name).into_os_string(),
        None => arg.into(),
    });
    let out =
        Command::new(env!("CARGO_BIN_EXE_omniprefix")).args(args).current_dir(repository_root()).output()?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(format!("`{}` exited with {:?}: {stderr}", step.args.join(" "), out.status.code()).into());
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// Keys whose values change from run to run.
fn is_timing(key: &str) -> bool {
    key.ends_with("_ms") || key.ends_with("_ms_median") || key.ends_with("_per_s")
}

/// Whether the printed JSON has every key the README shows, with its value.
fn json_matches(want: &Value, got: &Value) -> Result<(), String> {
    let want = want.as_object().ok_or("a README JSON line that is not an object")?;
    for (key, value) in want {
        let found = got.get(key).ok_or_else(|| format!("no `{key}` in the printed JSON {got}"))?;
        let same = if is_timing(key) {
            found.is_number() || (found.is_null() && value.is_null())
        } else {
            found == value
        };
        if !same {
            return Err(format!("`{key}`: the README shows {value}, the command printed {found}"));
        }
    }
    Ok(())
}

/// Whether `stdout` prints the README's lines for it, in order.
fn check(expected: &[String], stdout: &str) -> Result<(), String> {
    let printed: Vec<&str> = stdout.lines().collect();
    let mut next = 0;
    for want in expected {
        let json: Option<Value> = want
            .starts_with('{')
            .then(|| serde_json::from_str(want))
            .transpose()
            .map_err(|e| format!("README JSON {want}: {e}"))?;
        let mut failure = format!("the README shows `{want}`, which is not printed (in order) in:\n{stdout}");
        let found =
            printed[next..].iter().position(|line| match (&json, serde_json::from_str::<Value>(line)) {
                (Some(want), Ok(got)) => json_matches(want, &got)
                    .map_err(|why| failure = format!("{why}\nprinted:\n{stdout}"))
                    .is_ok(),
                (Some(_), Err(_)) => false,
                (None, _) => *line == want,
            });
        next += found.ok_or(failure)? + 1;
    }
    Ok(())
}

fn scratch(test: &str) -> TestResult<PathBuf> {
    common::scratch("quickstart", test)
}

#[test]
fn every_quick_start_command_prints_what_the_readme_says() -> TestResult {
    let dir = scratch("readme")?;
    let steps = steps(&readme()?)?;
    for step in &steps {
        let stdout = run(step, &dir)?;
        check(&step.expected, &stdout).map_err(|why| format!("`{}`: {why}", step.args.join(" ")))?;
    }
    assert!(steps.len() >= 3, "a text request, an image + text request and its hidden states: {steps:?}");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn a_drifted_readme_fails() -> TestResult {
    let dir = scratch("drift")?;
    let text = readme()?;
    let first = steps(&text)?.remove(0);
    let stdout = run(&first, &dir)?;
    check(&first.expected, &stdout)?;

    // A renamed flag: the command fails.
    let renamed = text.replacen("--max-tokens", "--max-token", 1);
    assert!(run(&steps(&renamed)?.remove(0), &dir).is_err(), "a flag the binary does not know must fail");

    // A printed value or line that changed: the check fails.
    let mut shifted = first.expected.clone();
    let json = shifted.iter_mut().find(|line| line.starts_with('{')).ok_or("the first command shows JSON")?;
    *json = json.replacen("\"prompt_len\":", "\"prompt_len\":1", 1);
    assert!(check(&shifted, &stdout).is_err(), "{shifted:?}");
    assert!(check(&[String::from("num_cached_tokens: 999")], &stdout).is_err());

    // A command with no output block, or one that needs a shell, is refused.
    let unanswered = text.replacen("--json\n", "--json\nomniprefix --version\n", 1);
    assert!(steps(&unanswered).is_err(), "every command needs its output block");
    assert!(commands("omniprefix hidden --out $OUT").is_err());
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
