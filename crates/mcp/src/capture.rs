//! Output kept within a cap: the head and the tail of a stream, with a marker where the middle
//! was cut. The tail matters as much as the head to a model (errors come last), and memory stays
//! bounded whatever the program prints.

use std::collections::VecDeque;

/// One stream's output, at most `cap` bytes of it kept.
#[derive(Debug)]
pub struct Capture {
    head: Vec<u8>,
    tail: VecDeque<u8>,
    head_cap: usize,
    tail_cap: usize,
    total: u64,
}

impl Capture {
    pub fn new(cap: usize) -> Capture {
        let head_cap = cap / 2;
        Capture { head: Vec::new(), tail: VecDeque::new(), head_cap, tail_cap: cap - head_cap, total: 0 }
    }

    pub fn push(&mut self, mut b: &[u8]) {
        self.total += b.len() as u64;
        if self.head.len() < self.head_cap {
            let n = b.len().min(self.head_cap - self.head.len());
            self.head.extend_from_slice(&b[..n]);
            b = &b[n..];
        }
        if b.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&b[b.len() - self.tail_cap..]);
            return;
        }
        let overflow = (self.tail.len() + b.len()).saturating_sub(self.tail_cap);
        self.tail.drain(..overflow);
        self.tail.extend(b);
    }

    /// Bytes seen in all.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes left out.
    pub fn dropped(&self) -> u64 {
        self.total - (self.head.len() + self.tail.len()) as u64
    }

    /// The kept text (invalid UTF-8 replaced), with `[... N bytes of NAME cut ...]` between head
    /// and tail when something was left out.
    pub fn render(&self, name: &str) -> String {
        let tail: Vec<u8> = self.tail.iter().copied().collect();
        let dropped = self.dropped();
        if dropped == 0 {
            let mut all = self.head.clone();
            all.extend_from_slice(&tail);
            return String::from_utf8_lossy(&all).into_owned();
        }
        format!(
            "{}\n[... {dropped} bytes of {name} cut; {} in all ...]\n{}",
            String::from_utf8_lossy(&self.head),
            self.total,
            String::from_utf8_lossy(&tail)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_output_is_kept_whole() {
        let mut c = Capture::new(16);
        c.push(b"hello ");
        c.push(b"world");
        assert_eq!(c.render("stdout"), "hello world");
        assert_eq!(c.dropped(), 0);
    }

    #[test]
    fn long_output_keeps_head_and_tail_with_a_marker() {
        let mut c = Capture::new(10);
        for i in 0..100u8 {
            c.push(&[b'a' + (i % 26)]);
        }
        assert_eq!(c.total(), 100);
        assert_eq!(c.dropped(), 90);
        let r = c.render("stdout");
        assert!(r.starts_with("abcde\n[... 90 bytes of stdout cut; 100 in all ...]\n"), "{r}");
        // The last five bytes pushed were for i = 95..99: 'r' (95 % 26 = 17) onwards.
        assert!(r.ends_with("rstuv"), "{r}");
        let mut big = Capture::new(10);
        big.push(&[b'x'; 1000]);
        big.push(b"END");
        assert!(big.render("stderr").ends_with("xxEND"));
        assert_eq!(big.dropped(), 993);
    }
}
