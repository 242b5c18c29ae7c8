//! Terminal progress for image builds: a bar over the build's stages plus its latest line.

use indicatif::{ProgressBar, ProgressStyle};
use std::time::Duration;

pub struct Bar {
    bar: ProgressBar,
    title: String,
}

impl Bar {
    pub fn new(title: &str) -> Bar {
        let bar = ProgressBar::new(1);
        bar.set_style(
            ProgressStyle::with_template("{spinner:.cyan} {prefix:.bold} [{bar:24.cyan/blue}] {pos}/{len} {wide_msg:.dim}  {elapsed}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(title.to_string());
        bar.enable_steady_tick(Duration::from_millis(120));
        Bar { bar, title: title.to_string() }
    }

    pub fn finish(&self, msg: &str) {
        self.bar.finish_and_clear();
        eprintln!("{}: {msg}", self.title);
    }

    pub fn abandon(&self) {
        self.bar.abandon();
    }
}

impl cordon_image::Progress for Bar {
    fn stage(&mut self, index: usize, total: usize, name: &str) {
        self.bar.set_length(total as u64);
        self.bar.set_position(index as u64);
        self.bar.set_prefix(format!("{}: {name}", self.title));
        // When stderr is not a terminal the bar is hidden: keep a plain log of stages instead.
        if self.bar.is_hidden() {
            eprintln!("{}: [{}/{}] {name}", self.title, index + 1, total);
        }
    }

    fn line(&mut self, text: &str) {
        let t: String = text.chars().filter(|c| !c.is_control()).take(100).collect();
        self.bar.set_message(t);
    }
}

/// A [`Bar`] shown only once something reports a stage: a step that is usually cached (a VM's
/// kit and disk) stays silent when it is.
pub struct Lazy {
    title: &'static str,
    bar: Option<Bar>,
}

impl Lazy {
    pub fn new(title: &'static str) -> Lazy {
        Lazy { title, bar: None }
    }

    /// The bar, if anything was shown.
    pub fn bar(&self) -> Option<&Bar> {
        self.bar.as_ref()
    }
}

impl cordon_image::Progress for Lazy {
    fn stage(&mut self, index: usize, total: usize, name: &str) {
        let title = self.title;
        self.bar.get_or_insert_with(|| Bar::new(title)).stage(index, total, name);
    }

    fn line(&mut self, text: &str) {
        if let Some(b) = &mut self.bar {
            b.line(text);
        }
    }
}
