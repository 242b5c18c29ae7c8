//! File metadata kept in `user.e2b.*` extended attributes.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use cordon_envd::files::METADATA_XATTR_PREFIX;

/// Metadata values larger than this are not read (the kernel caps them at 64 KiB anyway).
const MAX_VALUE: usize = 64 << 10;

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn list_names(path: &CString) -> io::Result<Vec<u8>> {
    // SAFETY: a NULL buffer of size 0 asks for the needed size only.
    let size = unsafe { libc::llistxattr(path.as_ptr(), std::ptr::null_mut(), 0) };
    if size < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; size as usize];
    if buf.is_empty() {
        return Ok(buf);
    }
    // SAFETY: buf is valid for writes of buf.len() bytes.
    let n = unsafe { libc::llistxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// The `user.e2b.*` attributes of `path` (not following a final symlink), prefix stripped.
/// Filesystems without xattr support simply have no metadata.
pub(crate) fn read(path: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(cpath) = c_path(path) else { return out };
    let Ok(names) = list_names(&cpath) else { return out };
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Some(key) = name.strip_prefix(METADATA_XATTR_PREFIX.as_bytes()) else { continue };
        let Ok(cname) = CString::new(name) else { continue };
        let mut buf = vec![0u8; MAX_VALUE];
        // SAFETY: buf is valid for writes of buf.len() bytes; both strings are NUL-terminated.
        let n = unsafe { libc::lgetxattr(cpath.as_ptr(), cname.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            continue;
        }
        buf.truncate(n as usize);
        out.insert(String::from_utf8_lossy(key).into_owned(), String::from_utf8_lossy(&buf).into_owned());
    }
    out
}

/// Stores one metadata entry as `user.e2b.<key>`.
pub(crate) fn write(path: &Path, key: &str, value: &str) -> io::Result<()> {
    let cpath = c_path(path)?;
    let cname = CString::new(format!("{METADATA_XATTR_PREFIX}{key}"))
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: value is valid for reads of value.len() bytes; both strings are NUL-terminated.
    let r = unsafe {
        libc::lsetxattr(cpath.as_ptr(), cname.as_ptr(), value.as_ptr().cast(), value.len(), 0)
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `metadata` the whole of `path`'s metadata: entries of an earlier write that this one
/// does not name are removed (a file written again without metadata has none, as in E2B).
pub(crate) fn replace(path: &Path, metadata: &[(String, String)]) -> io::Result<()> {
    let cpath = c_path(path)?;
    // A filesystem without xattrs has nothing to remove; writing will say if it matters.
    let names = list_names(&cpath).unwrap_or_default();
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Some(key) = name.strip_prefix(METADATA_XATTR_PREFIX.as_bytes()) else { continue };
        if metadata.iter().any(|(k, _)| k.as_bytes() == key) {
            continue;
        }
        let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: both strings are NUL-terminated and live across the call.
        if unsafe { libc::lremovexattr(cpath.as_ptr(), cname.as_ptr()) } < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENODATA) {
                return Err(e);
            }
        }
    }
    metadata.iter().try_for_each(|(k, v)| write(path, k, v))
}
