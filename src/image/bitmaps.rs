//! The image's side of changed-block tracking: which disks keep dirty bitmaps in their file
//! (qcow2 version 3, served read-write), and the calls that keep them there
//! (`qcow2::bitmap_store` does the work).

use super::{Image, ImageError};

impl Image {
    /// The persistent dirty bitmaps the image file holds (qcow2; none for other disks).
    pub fn persistent_bitmaps(&self) -> Vec<crate::bitmaps::Persistent> {
        self.qcow2()
            .map(|(_, d)| d.q.persistent_bitmaps())
            .unwrap_or_default()
    }

    /// Why this disk keeps dirty bitmaps in memory only (None: its file can keep them).
    pub fn bitmaps_memory_only(&self) -> Option<String> {
        match self.qcow2() {
            None => Some(
                "this disk keeps bitmaps in memory only (persistent bitmaps need a qcow2 image)"
                    .into(),
            ),
            Some(_) if self.read_only() => {
                Some("the disk is served read-only: its bitmaps cannot change".into())
            }
            Some((_, d)) if d.q.version < 3 => Some(
                "a version 2 qcow2 image cannot keep bitmaps (qemu-img amend -o compat=1.1)".into(),
            ),
            Some(_) => None,
        }
    }

    /// Write the persistent bitmaps `list` to the image file (see `qcow2::bitmap_store`).
    pub fn save_bitmaps(&self, list: &[crate::bitmaps::Persistent]) -> Result<(), ImageError> {
        if !self.is_active() {
            return Err(ImageError::Unsupported(
                "the image is handed over to another process".into(),
            ));
        }
        match self.qcow2() {
            Some((file, d)) => d.q.save_bitmaps(file, list),
            None => Err(ImageError::Unsupported(
                "only qcow2 images keep persistent bitmaps".into(),
            )),
        }
    }

    /// Write newly set words of persistent bitmaps into the file (before the requests that
    /// set them complete).
    pub fn persist_marks(&self, marks: &[crate::bitmaps::Mark]) -> Result<(), ImageError> {
        if !self.is_active() {
            return Ok(());
        }
        match self.qcow2() {
            Some((file, d)) => d.q.persist_marks(file, marks),
            None => Ok(()),
        }
    }
}
