//! The agent's configuration for a sandbox, the same on every tier.

use std::path::PathBuf;

use crate::SandboxSpec;

/// The user commands run as unless they name one: the spec's, except that an OCI image's own
/// `User` wins over cordon's default (`user`, which such an image rarely has).
fn default_user(spec: &SandboxSpec, image: &cordon_image::Image) -> String {
    if spec.user == SandboxSpec::default().user && !image.meta.layers.is_empty() {
        image.meta.default_user.clone()
    } else {
        spec.user.clone()
    }
}

/// The agent's configuration for `spec`: the image's environment, then the spec's.
pub fn config(spec: &SandboxSpec, image: &cordon_image::Image, envd_version: Option<&str>) -> cordon_agent::AgentConfig {
    let mut env = image.meta.env.clone();
    // A sandbox that trusts the egress CA says so to the clients that keep their own stores;
    // over the image's values, under the sandbox's own.
    if spec.trusted_egress_ca().is_some() {
        for (k, v) in cordon_host::trust::env() {
            env.retain(|(ek, _)| ek != k);
            env.push((k.to_string(), v.to_string()));
        }
    }
    for (k, v) in &spec.env {
        env.retain(|(ek, _)| ek != k);
        env.push((k.clone(), v.clone()));
    }
    cordon_agent::AgentConfig {
        sandbox_id: spec.id.clone(),
        default_user: default_user(spec, image),
        workdir: spec.workdir.clone().or_else(|| image.meta.workdir.clone()),
        env,
        root: PathBuf::from("/"),
        envd_version: envd_version.map(str::to_string),
        isolate_commands: false,
    }
}
