package replica

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
)

// FS is the filesystem seam of the store: everything it does to disk goes
// through it, so tests can inject faults (replica/errorfs) or model a
// crash that loses unsynced data (errorfs.MemFS).
//
// Durability contract the store relies on, and that a fake must model:
// data written to a File is durable once File.Sync returns; a directory
// entry (create, rename, remove) is durable once SyncDir of its directory
// returns; a rename replaces its target atomically.
type FS interface {
	OpenFile(name string, flag int, perm os.FileMode) (File, error)
	MkdirAll(path string, perm os.FileMode) error
	Remove(name string) error
	RemoveAll(path string) error
	Rename(oldpath, newpath string) error
	ReadDir(name string) ([]os.DirEntry, error)
	Stat(name string) (os.FileInfo, error)
	// SyncDir makes the entries of directory name durable.
	SyncDir(name string) error
}

// File is an open file of an FS.
type File interface {
	io.ReaderAt
	io.WriterAt
	// Sync makes the file's data (and the size needed to read it back)
	// durable. The OS implementation uses fdatasync.
	Sync() error
	Truncate(size int64) error
	Close() error
	Stat() (os.FileInfo, error)
	// PunchHole deallocates [off, off+n) without changing the file size;
	// the range reads as zeroes afterwards.
	PunchHole(off, n int64) error
}

// OS returns the FS of the operating system.
func OS() FS { return osFS{} }

type osFS struct{}

func (osFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	f, err := os.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

func (osFS) MkdirAll(path string, perm os.FileMode) error { return os.MkdirAll(path, perm) }
func (osFS) Remove(name string) error                     { return os.Remove(name) }
func (osFS) RemoveAll(path string) error                  { return os.RemoveAll(path) }
func (osFS) Rename(oldpath, newpath string) error         { return os.Rename(oldpath, newpath) }
func (osFS) ReadDir(name string) ([]os.DirEntry, error)   { return os.ReadDir(name) }
func (osFS) Stat(name string) (os.FileInfo, error)        { return os.Stat(name) }

func (osFS) SyncDir(name string) error {
	d, err := os.Open(name)
	if err != nil {
		return err
	}
	serr := d.Sync()
	cerr := d.Close()
	if serr != nil {
		return serr
	}
	return cerr
}

type osFile struct{ *os.File }

func (f osFile) Sync() error { return datasync(f.File) }

func (f osFile) PunchHole(off, n int64) error {
	if n <= 0 {
		return nil
	}
	err := punchHole(f.File, off, n)
	if errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS) {
		return writeZeroes(f.File, off, n)
	}
	return err
}

// writeZeroes is the fallback of PunchHole on filesystems that cannot punch.
func writeZeroes(f *os.File, off, n int64) error {
	st, err := f.Stat()
	if err != nil {
		return err
	}
	end := min(off+n, st.Size()) // KEEP_SIZE: never extend
	buf := make([]byte, min(end-off, 1<<20))
	for off < end {
		k := min(int64(len(buf)), end-off)
		if _, err := f.WriteAt(buf[:k], off); err != nil {
			return err
		}
		off += k
	}
	return nil
}

// ioErr classifies an error of the filesystem for callers of the store:
// ENOSPC and EDQUOT become ErrNoSpace, anything else ErrIO. The original
// error stays in the chain (errors.Is finds both) and op names what the
// store was doing.
func ioErr(op string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrIO) || errors.Is(err, ErrNoSpace) || errors.Is(err, ErrCorrupt) {
		return fmt.Errorf("%s: %w", op, err)
	}
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return fmt.Errorf("%w: %s: %w", ErrNoSpace, op, err)
	}
	return fmt.Errorf("%w: %s: %w", ErrIO, op, err)
}

// readFull reads len(p) bytes at off; bytes past the end of the file read
// as zeroes (layer files are sparse and may be shorter than the volume).
func readFull(f File, p []byte, off int64) error {
	n, err := f.ReadAt(p, off)
	if err == io.EOF || (err == nil && n < len(p)) {
		clear(p[n:])
		return nil
	}
	return err
}

// readWhole returns the whole content of a small file.
func readWhole(f File) ([]byte, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	buf := make([]byte, st.Size())
	n, err := f.ReadAt(buf, 0)
	if err != nil && err != io.EOF {
		return nil, err
	}
	return buf[:n], nil
}
