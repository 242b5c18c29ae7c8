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

/// One bar per item going on at once (the layers of a pull), with its bytes; lines above them.
/// Without a terminal the bars are hidden and every line is printed instead.
pub struct Items {
    title: String,
    multi: indicatif::MultiProgress,
    bars: std::collections::HashMap<String, ProgressBar>,
}

impl Items {
    pub fn new(title: &str) -> Items {
        Items { title: title.to_string(), multi: indicatif::MultiProgress::new(), bars: Default::default() }
    }

    pub fn finish(&self, msg: &str) {
        for b in self.bars.values() {
            b.finish_and_clear();
        }
        let _ = self.multi.clear();
        eprintln!("{}: {msg}", self.title);
    }

    pub fn abandon(&self) {
        for b in self.bars.values() {
            b.abandon();
        }
    }
}

impl cordon_image::Progress for Items {
    fn stage(&mut self, index: usize, total: usize, name: &str) {
        self.line(&format!("[{}/{total}] {name}", index + 1));
    }

    fn line(&mut self, text: &str) {
        let t: String = text.chars().filter(|c| !c.is_control()).take(160).collect();
        if self.multi.is_hidden() {
            eprintln!("{}: {t}", self.title);
        } else {
            let _ = self.multi.println(format!("{}: {t}", self.title));
        }
    }

    fn bytes(&mut self, item: &str, done: u64, total: Option<u64>) {
        let multi = &self.multi;
        let bar = self.bars.entry(item.to_string()).or_insert_with(|| {
            let b = multi.add(ProgressBar::new(total.unwrap_or(0)));
            b.set_style(
                ProgressStyle::with_template("{prefix:.bold} [{bar:24.cyan/blue}] {bytes}/{total_bytes} {bytes_per_sec}")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            b.set_prefix(item.to_string());
            b
        });
        bar.set_position(done);
    }
}
