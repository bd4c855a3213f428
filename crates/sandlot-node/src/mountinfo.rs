//! Reading the mount table of the calling thread (`/proc/thread-self/mountinfo`,
//! proc_pid_mountinfo(5)).
use std::path::{Path, PathBuf};

/// Mount points at or below `dir` in the calling thread's mount namespace, deepest first
/// (children before parents, the order to unmount them in). An unreadable mount table
/// gives an empty list.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(s) = std::fs::read_to_string("/proc/thread-self/mountinfo") else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = s
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape(m)))
        .filter(|m| m.starts_with(dir))
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v
}

/// Undo mountinfo's octal escapes (`\040` for a space, `\134` for a backslash).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/x\134y"), r"/x\y");
        assert_eq!(unescape("/a\\040b\\011c"), "/a b\tc");
        assert_eq!(unescape("/plain\\"), "/plain\\");
        assert_eq!(unescape("/plain"), "/plain");
    }
}
