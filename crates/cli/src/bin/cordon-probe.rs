//! `cordon-probe`: `cordon probe` as a program of its own (see `probe.rs`), small enough for the
//! tests and `GET /sandboxes/{id}/isolation?verify=true` to copy into a sandbox.

#[path = "../probe.rs"]
mod probe;

fn main() {
    println!("{}", probe::report());
}
