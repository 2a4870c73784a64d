use std::process::Command;

// The migrations are embedded at compile time (refinery): rebuild when they change.
// The commit the build is made from goes into `oncepay --version`, the start-up line and
// `oncepay_build_info` (replicas of two builds serve together during a rollout, and every
// build's package version is the same): ONCEPAY_BUILD_COMMIT if set, else git's HEAD, else
// "unknown" (a source tree without git).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-env-changed=ONCEPAY_BUILD_COMMIT");
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .map(|text| text.trim().to_owned())
            .filter(|text| !text.is_empty())
    };
    let commit = std::env::var("ONCEPAY_BUILD_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_owned());
    // Built again when HEAD moves: HEAD itself (a checkout) and the ref it names (a commit).
    for path in ["HEAD", "packed-refs"] {
        if let Some(file) = git(&["rev-parse", "--git-path", path]) {
            println!("cargo:rerun-if-changed={file}");
        }
    }
    if let Some(head_ref) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(file) = git(&["rev-parse", "--git-path", &head_ref]) {
            println!("cargo:rerun-if-changed={file}");
        }
    }
    println!("cargo:rustc-env=ONCEPAY_BUILD_COMMIT={commit}");
}
