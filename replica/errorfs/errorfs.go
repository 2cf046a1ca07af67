// Package errorfs injects faults into a replica.FS, and provides MemFS, an
// in-memory filesystem that can be crashed to lose what was not synced.
//
// A FS wraps another and consults its rules before every operation: a
// rule matches by path substring and operation kind, can wait for a number
// of matching operations, fire a limited number of times or with a
// probability (from a seeded generator, so a failing test reproduces), and
// then fails the operation with an errno (EIO, ENOSPC, ...), tears a write
// (applies a prefix, then fails or claims success), or skips the operation
// while claiming success (a lying disk).
package errorfs

import (
	"fmt"
	"io/fs"
	"math/rand"
	"os"
	"strings"
	"sync"
	"syscall"

	"github.com/stor-io/stor/replica"
)

// Op is a kind of filesystem operation; Ops combine with |.
type Op uint32

const (
	OpRead Op = 1 << iota
	OpWrite
	OpSync
	OpPunch
	OpTruncate
	OpOpen
	OpRemove
	OpRename
	OpMkdir
	OpSyncDir
	OpReadDir
	OpStat
	OpClose

	// OpAll matches every operation.
	OpAll Op = 1<<iota - 1
)

var opNames = map[Op]string{
	OpRead: "read", OpWrite: "write", OpSync: "sync", OpPunch: "punch", OpTruncate: "truncate",
	OpOpen: "open", OpRemove: "remove", OpRename: "rename", OpMkdir: "mkdir", OpSyncDir: "syncdir",
	OpReadDir: "readdir", OpStat: "stat", OpClose: "close",
}

func (o Op) String() string {
	if n, ok := opNames[o]; ok {
		return n
	}
	return fmt.Sprintf("ops(%#x)", uint32(o))
}

// Action is what a rule does to an operation it fires on.
type Action int

const (
	// Fail returns the rule's error without doing the operation.
	Fail Action = iota
	// Skip does nothing and reports success: a lying disk (for OpSync, the
	// data stays unsynced and a MemFS crash can lose it).
	Skip
	// TornFail applies the first TornBytes of a write, then returns the
	// rule's error. Other operations fail as with Fail.
	TornFail
	// TornSkip applies the first TornBytes of a write and reports that the
	// whole write succeeded. Other operations are skipped as with Skip.
	TornSkip
)

// Rule selects operations and says what to do to them. The zero Rule
// fails every operation with EIO.
type Rule struct {
	// Path: the operation's path contains it ("" matches all).
	Path string
	// Ops the rule applies to; 0 means OpAll.
	Ops Op
	// After: let this many matching operations pass before firing.
	After int
	// Times: fire at most this many times (0: no limit).
	Times int
	// Prob: fire with this probability (0: always).
	Prob float64
	// Action to take. Default Fail.
	Action Action
	// Err returned by Fail and TornFail. Default syscall.EIO.
	Err error
	// TornBytes of a torn write that are applied. Default: half the write,
	// rounded down to a multiple of 512.
	TornBytes int

	seen, fired int // guarded by FS.mu
}

// FS is a replica.FS that injects faults into another.
type FS struct {
	inner replica.FS

	mu    sync.Mutex
	rng   *rand.Rand
	rules []*Rule
}

var _ replica.FS = (*FS)(nil)

// New wraps inner; seed drives probabilistic rules.
func New(inner replica.FS, seed int64) *FS {
	return &FS{inner: inner, rng: rand.New(rand.NewSource(seed))}
}

// Inner returns the wrapped FS.
func (f *FS) Inner() replica.FS { return f.inner }

// Add installs a rule and returns it (to pass to Fired or Drop).
func (f *FS) Add(r Rule) *Rule {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.Ops == 0 {
		r.Ops = OpAll
	}
	if r.Err == nil {
		r.Err = syscall.EIO
	}
	rp := &r
	f.rules = append(f.rules, rp)
	return rp
}

// Drop uninstalls a rule.
func (f *FS) Drop(r *Rule) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, x := range f.rules {
		if x == r {
			f.rules = append(f.rules[:i], f.rules[i+1:]...)
			return
		}
	}
}

// Reset uninstalls every rule.
func (f *FS) Reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rules = nil
}

// Fired returns how many times r fired.
func (f *FS) Fired(r *Rule) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return r.fired
}

// match returns the first rule that fires on op at path, or nil.
func (f *FS) match(op Op, path string) *Rule {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.rules {
		if r.Ops&op == 0 || !strings.Contains(path, r.Path) {
			continue
		}
		r.seen++
		if r.seen <= r.After || (r.Times > 0 && r.fired >= r.Times) {
			continue
		}
		if r.Prob > 0 && f.rng.Float64() >= r.Prob {
			continue
		}
		r.fired++
		return r
	}
	return nil
}

// inject returns (handled, err): handled means the operation must not run.
func (f *FS) inject(op Op, path string) (bool, error) {
	r := f.match(op, path)
	if r == nil {
		return false, nil
	}
	switch r.Action {
	case Skip, TornSkip:
		return true, nil
	default:
		return true, &fs.PathError{Op: op.String(), Path: path, Err: r.Err}
	}
}

func (f *FS) OpenFile(name string, flag int, perm os.FileMode) (replica.File, error) {
	if ok, err := f.inject(OpOpen, name); ok {
		if err == nil {
			err = &fs.PathError{Op: "open", Path: name, Err: syscall.EIO} // cannot fake a file
		}
		return nil, err
	}
	inner, err := f.inner.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return &file{fs: f, inner: inner, name: name}, nil
}

func (f *FS) MkdirAll(path string, perm os.FileMode) error {
	if ok, err := f.inject(OpMkdir, path); ok {
		return err
	}
	return f.inner.MkdirAll(path, perm)
}

func (f *FS) Remove(name string) error {
	if ok, err := f.inject(OpRemove, name); ok {
		return err
	}
	return f.inner.Remove(name)
}

func (f *FS) RemoveAll(path string) error {
	if ok, err := f.inject(OpRemove, path); ok {
		return err
	}
	return f.inner.RemoveAll(path)
}

func (f *FS) Rename(oldpath, newpath string) error {
	if ok, err := f.inject(OpRename, oldpath+" -> "+newpath); ok {
		return err
	}
	return f.inner.Rename(oldpath, newpath)
}

func (f *FS) ReadDir(name string) ([]os.DirEntry, error) {
	if ok, err := f.inject(OpReadDir, name); ok {
		if err == nil {
			return nil, nil
		}
		return nil, err
	}
	return f.inner.ReadDir(name)
}

func (f *FS) Stat(name string) (os.FileInfo, error) {
	if ok, err := f.inject(OpStat, name); ok {
		if err == nil {
			err = &fs.PathError{Op: "stat", Path: name, Err: syscall.EIO}
		}
		return nil, err
	}
	return f.inner.Stat(name)
}

func (f *FS) SyncDir(name string) error {
	if ok, err := f.inject(OpSyncDir, name); ok {
		return err
	}
	return f.inner.SyncDir(name)
}

type file struct {
	fs    *FS
	inner replica.File
	name  string
}

func (f *file) ReadAt(p []byte, off int64) (int, error) {
	if ok, err := f.fs.inject(OpRead, f.name); ok {
		if err == nil {
			clear(p)
			return len(p), nil
		}
		return 0, err
	}
	return f.inner.ReadAt(p, off)
}

func (f *file) WriteAt(p []byte, off int64) (int, error) {
	r := f.fs.match(OpWrite, f.name)
	if r == nil {
		return f.inner.WriteAt(p, off)
	}
	switch r.Action {
	case Skip:
		return len(p), nil
	case Fail:
		return 0, &fs.PathError{Op: "write", Path: f.name, Err: r.Err}
	}
	k := r.TornBytes
	if k <= 0 || k > len(p) {
		k = len(p) / 2 / 512 * 512
	}
	n, err := f.inner.WriteAt(p[:k], off)
	if err != nil {
		return n, err
	}
	if r.Action == TornSkip {
		return len(p), nil
	}
	return n, &fs.PathError{Op: "write", Path: f.name, Err: r.Err}
}

func (f *file) Sync() error {
	if ok, err := f.fs.inject(OpSync, f.name); ok {
		return err
	}
	return f.inner.Sync()
}

func (f *file) Truncate(size int64) error {
	if ok, err := f.fs.inject(OpTruncate, f.name); ok {
		return err
	}
	return f.inner.Truncate(size)
}

func (f *file) PunchHole(off, n int64) error {
	if ok, err := f.fs.inject(OpPunch, f.name); ok {
		return err
	}
	return f.inner.PunchHole(off, n)
}

func (f *file) Close() error {
	if ok, err := f.fs.inject(OpClose, f.name); ok {
		f.inner.Close()
		return err
	}
	return f.inner.Close()
}

func (f *file) Stat() (os.FileInfo, error) {
	if ok, err := f.fs.inject(OpStat, f.name); ok {
		if err == nil {
			err = &fs.PathError{Op: "stat", Path: f.name, Err: syscall.EIO}
		}
		return nil, err
	}
	return f.inner.Stat()
}
