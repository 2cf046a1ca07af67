package errorfs

import (
	"io"
	"io/fs"
	"maps"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/stor-io/stor/replica"
)

// PageSize is the unit in which MemFS loses unsynced data in a crash.
const PageSize = 4096

type page [PageSize]byte

// MemFS is an in-memory replica.FS that remembers what is durable, so a
// test can crash it: Crash returns the disk as a power cut could leave it.
//
// The model, which is what the store may assume of a real disk and
// filesystem (and no more):
//   - A file's data and size are durable once File.Sync returns. Each page
//     (4096 bytes) written, punched or truncated since the file's last
//     Sync independently survives a crash with its newest content or
//     reverts to its content at that Sync; the size survives as the newest
//     or the synced one.
//   - A directory entry (a create, rename or remove of a name) is durable
//     once SyncDir of its directory returns. Each name changed since then
//     independently survives or reverts to what it named at that SyncDir
//     (so an unsynced rename may show both names, either, or neither).
//   - A rename atomically replaces its target name.
//
// MemFS is safe for concurrent use.
type MemFS struct {
	mu   sync.Mutex
	root *memDir
}

type memNode interface{ isNode() }

type memDir struct {
	entries map[string]memNode // now
	synced  map[string]memNode // as of the last SyncDir
}

type memInode struct {
	pages  map[int64]*page // now; an absent page reads as zeroes
	size   int64
	spages map[int64]*page // as of the last Sync (pages are shared, copy on write)
	ssize  int64
	dirty  map[int64]bool // pages changed since the last Sync
}

func (*memDir) isNode()   {}
func (*memInode) isNode() {}

func newDir() *memDir {
	return &memDir{entries: map[string]memNode{}, synced: map[string]memNode{}}
}

func newInode() *memInode {
	return &memInode{pages: map[int64]*page{}, spages: map[int64]*page{}, dirty: map[int64]bool{}}
}

// NewMemFS returns an empty MemFS.
func NewMemFS() *MemFS { return &MemFS{root: newDir()} }

var _ replica.FS = (*MemFS)(nil)

func split(name string) []string {
	name = filepath.ToSlash(filepath.Clean(name))
	name = strings.Trim(name, "/")
	if name == "" || name == "." {
		return nil
	}
	return strings.Split(name, "/")
}

func pathErr(op, name string, err error) error { return &fs.PathError{Op: op, Path: name, Err: err} }

// lookupDir returns the directory at parts. The caller holds mu.
func (m *MemFS) lookupDir(parts []string) (*memDir, error) {
	d := m.root
	for _, p := range parts {
		n, ok := d.entries[p]
		if !ok {
			return nil, fs.ErrNotExist
		}
		sub, ok := n.(*memDir)
		if !ok {
			return nil, syscall.ENOTDIR
		}
		d = sub
	}
	return d, nil
}

// parent returns the parent directory of name and the base name.
func (m *MemFS) parent(name string) (*memDir, string, error) {
	parts := split(name)
	if len(parts) == 0 {
		return nil, "", syscall.EINVAL
	}
	d, err := m.lookupDir(parts[:len(parts)-1])
	return d, parts[len(parts)-1], err
}

func (m *MemFS) OpenFile(name string, flag int, perm os.FileMode) (replica.File, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	d, base, err := m.parent(name)
	if err != nil {
		return nil, pathErr("open", name, err)
	}
	n, ok := d.entries[base]
	if ok && flag&os.O_CREATE != 0 && flag&os.O_EXCL != 0 {
		return nil, pathErr("open", name, fs.ErrExist)
	}
	if !ok {
		if flag&os.O_CREATE == 0 {
			return nil, pathErr("open", name, fs.ErrNotExist)
		}
		n = newInode()
		d.entries[base] = n
	}
	ino, isFile := n.(*memInode)
	if !isFile {
		return nil, pathErr("open", name, syscall.EISDIR)
	}
	if flag&os.O_TRUNC != 0 {
		ino.truncate(0)
	}
	return &memFile{fs: m, ino: ino, name: name, readOnly: flag&(os.O_WRONLY|os.O_RDWR) == 0}, nil
}

func (m *MemFS) MkdirAll(path string, perm os.FileMode) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	d := m.root
	for _, p := range split(path) {
		n, ok := d.entries[p]
		if !ok {
			n = newDir()
			d.entries[p] = n
		}
		sub, ok := n.(*memDir)
		if !ok {
			return pathErr("mkdir", path, syscall.ENOTDIR)
		}
		d = sub
	}
	return nil
}

func (m *MemFS) Remove(name string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	d, base, err := m.parent(name)
	if err != nil {
		return pathErr("remove", name, err)
	}
	n, ok := d.entries[base]
	if !ok {
		return pathErr("remove", name, fs.ErrNotExist)
	}
	if sub, isDir := n.(*memDir); isDir && len(sub.entries) > 0 {
		return pathErr("remove", name, syscall.ENOTEMPTY)
	}
	delete(d.entries, base)
	return nil
}

func (m *MemFS) RemoveAll(path string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	d, base, err := m.parent(path)
	if err != nil {
		if err == fs.ErrNotExist {
			return nil
		}
		return pathErr("removeall", path, err)
	}
	delete(d.entries, base)
	return nil
}

func (m *MemFS) Rename(oldpath, newpath string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	od, obase, err := m.parent(oldpath)
	if err != nil {
		return pathErr("rename", oldpath, err)
	}
	nd, nbase, err := m.parent(newpath)
	if err != nil {
		return pathErr("rename", newpath, err)
	}
	n, ok := od.entries[obase]
	if !ok {
		return pathErr("rename", oldpath, fs.ErrNotExist)
	}
	if old, ok := nd.entries[nbase]; ok {
		if sub, isDir := old.(*memDir); isDir && len(sub.entries) > 0 {
			return pathErr("rename", newpath, syscall.ENOTEMPTY)
		}
	}
	delete(od.entries, obase)
	nd.entries[nbase] = n
	return nil
}

func (m *MemFS) ReadDir(name string) ([]os.DirEntry, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	d, err := m.lookupDir(split(name))
	if err != nil {
		return nil, pathErr("readdir", name, err)
	}
	var out []os.DirEntry
	for _, k := range slices.Sorted(maps.Keys(d.entries)) {
		out = append(out, fs.FileInfoToDirEntry(info(k, d.entries[k])))
	}
	return out, nil
}

func (m *MemFS) Stat(name string) (os.FileInfo, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	parts := split(name)
	if len(parts) == 0 {
		return info("/", m.root), nil
	}
	d, err := m.lookupDir(parts[:len(parts)-1])
	if err != nil {
		return nil, pathErr("stat", name, err)
	}
	n, ok := d.entries[parts[len(parts)-1]]
	if !ok {
		return nil, pathErr("stat", name, fs.ErrNotExist)
	}
	return info(parts[len(parts)-1], n), nil
}

func (m *MemFS) SyncDir(name string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	d, err := m.lookupDir(split(name))
	if err != nil {
		return pathErr("syncdir", name, err)
	}
	d.synced = make(map[string]memNode, len(d.entries))
	for k, v := range d.entries {
		d.synced[k] = v
	}
	return nil
}

// Crash returns the disk as a crash of this MemFS could leave it, choosing
// with rng seeded by seed which unsynced pages, sizes and names survive
// (see MemFS). The receiver is unchanged: stores still open on it keep
// running against the pre-crash state, as a dead process would not matter.
func (m *MemFS) Crash(seed int64) *MemFS {
	rng := rand.New(rand.NewSource(seed))
	return m.crash(func() bool { return rng.Intn(2) == 0 })
}

// CrashLoseAll returns the disk after a crash that loses everything not
// synced.
func (m *MemFS) CrashLoseAll() *MemFS { return m.crash(func() bool { return false }) }

func (m *MemFS) crash(keep func() bool) *MemFS {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := &crasher{keep: keep, dirs: map[*memDir]*memDir{}, inodes: map[*memInode]*memInode{}}
	return &MemFS{root: c.dir(m.root)}
}

type crasher struct {
	keep   func() bool
	dirs   map[*memDir]*memDir
	inodes map[*memInode]*memInode
}

func (c *crasher) dir(d *memDir) *memDir {
	if nd := c.dirs[d]; nd != nil {
		return nd
	}
	nd := newDir()
	c.dirs[d] = nd
	names := map[string]bool{}
	for k := range d.entries {
		names[k] = true
	}
	for k := range d.synced {
		names[k] = true
	}
	for _, k := range slices.Sorted(maps.Keys(names)) {
		now, then := d.entries[k], d.synced[k]
		pick := then
		if now == then || c.keep() {
			pick = now
		}
		if pick == nil {
			continue
		}
		switch n := pick.(type) {
		case *memDir:
			nd.entries[k] = c.dir(n)
		case *memInode:
			nd.entries[k] = c.inode(n)
		}
		nd.synced[k] = nd.entries[k]
	}
	return nd
}

func (c *crasher) inode(ino *memInode) *memInode {
	if ni := c.inodes[ino]; ni != nil {
		return ni
	}
	ni := newInode()
	c.inodes[ino] = ni
	for idx, p := range ino.spages {
		ni.pages[idx] = p
	}
	for _, idx := range slices.Sorted(maps.Keys(ino.dirty)) {
		if c.keep() {
			if p := ino.pages[idx]; p != nil {
				ni.pages[idx] = p
			} else {
				delete(ni.pages, idx)
			}
		}
	}
	ni.size = ino.ssize
	if ino.size != ino.ssize && c.keep() {
		ni.size = ino.size
	}
	ni.cutTo(ni.size)
	for idx, p := range ni.pages {
		ni.spages[idx] = p
	}
	ni.ssize = ni.size
	return ni
}

// writablePage returns page idx for writing, copying it if it is shared
// with the synced image.
func (ino *memInode) writablePage(idx int64) *page {
	p := ino.pages[idx]
	if p == nil || p == ino.spages[idx] {
		np := new(page)
		if p != nil {
			*np = *p
		}
		ino.pages[idx] = np
		p = np
	}
	ino.dirty[idx] = true
	return p
}

func (ino *memInode) writeAt(b []byte, off int64) {
	for len(b) > 0 {
		idx, po := off/PageSize, off%PageSize
		n := copy(ino.writablePage(idx)[po:], b)
		b, off = b[n:], off+int64(n)
		ino.size = max(ino.size, off)
	}
}

func (ino *memInode) readAt(b []byte, off int64) int {
	if off >= ino.size {
		return 0
	}
	b = b[:min(int64(len(b)), ino.size-off)]
	n := len(b)
	for len(b) > 0 {
		idx, po := off/PageSize, off%PageSize
		var k int
		if p := ino.pages[idx]; p != nil {
			k = copy(b, p[po:])
		} else {
			k = min(len(b), int(PageSize-po))
			clear(b[:k])
		}
		b, off = b[k:], off+int64(k)
	}
	return n
}

// zeroRange zeroes [off, off+n) dropping whole pages.
func (ino *memInode) zeroRange(off, n int64) {
	end := off + n
	for off < end {
		idx, po := off/PageSize, off%PageSize
		k := min(end-off, PageSize-po)
		if po == 0 && k == PageSize {
			if ino.pages[idx] != nil {
				delete(ino.pages, idx)
				ino.dirty[idx] = true
			}
		} else if ino.pages[idx] != nil {
			clear(ino.writablePage(idx)[po : po+k])
		}
		off += k
	}
}

// cutTo drops data past size (no dirty tracking: used on fresh images).
func (ino *memInode) cutTo(size int64) {
	for idx, p := range ino.pages {
		switch {
		case idx*PageSize >= size:
			delete(ino.pages, idx)
		case (idx+1)*PageSize > size:
			np := *p
			clear(np[size-idx*PageSize:])
			ino.pages[idx] = &np
		}
	}
}

func (ino *memInode) truncate(size int64) {
	if size < ino.size {
		lastPage := (ino.size + PageSize - 1) / PageSize
		ino.zeroRange(size, lastPage*PageSize-size)
	}
	ino.size = size
}

func (ino *memInode) sync() {
	for idx := range ino.dirty {
		if p := ino.pages[idx]; p != nil {
			ino.spages[idx] = p
		} else {
			delete(ino.spages, idx)
		}
	}
	clear(ino.dirty)
	ino.ssize = ino.size
}

type memFile struct {
	fs       *MemFS
	ino      *memInode
	name     string
	readOnly bool
	closed   bool
}

func (f *memFile) check(op string, write bool) error {
	if f.closed {
		return pathErr(op, f.name, os.ErrClosed)
	}
	if write && f.readOnly {
		return pathErr(op, f.name, syscall.EBADF)
	}
	return nil
}

func (f *memFile) ReadAt(b []byte, off int64) (int, error) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("read", false); err != nil {
		return 0, err
	}
	if off < 0 {
		return 0, pathErr("read", f.name, syscall.EINVAL)
	}
	n := f.ino.readAt(b, off)
	if n < len(b) {
		return n, io.EOF
	}
	return n, nil
}

func (f *memFile) WriteAt(b []byte, off int64) (int, error) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("write", true); err != nil {
		return 0, err
	}
	if off < 0 {
		return 0, pathErr("write", f.name, syscall.EINVAL)
	}
	f.ino.writeAt(b, off)
	return len(b), nil
}

func (f *memFile) Sync() error {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("sync", false); err != nil {
		return err
	}
	f.ino.sync()
	return nil
}

func (f *memFile) Truncate(size int64) error {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("truncate", true); err != nil {
		return err
	}
	if size < 0 {
		return pathErr("truncate", f.name, syscall.EINVAL)
	}
	f.ino.truncate(size)
	return nil
}

func (f *memFile) PunchHole(off, n int64) error {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("punch", true); err != nil {
		return err
	}
	if off < 0 || n < 0 {
		return pathErr("punch", f.name, syscall.EINVAL)
	}
	f.ino.zeroRange(off, min(off+n, f.ino.size)-off)
	return nil
}

func (f *memFile) Close() error {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if f.closed {
		return pathErr("close", f.name, os.ErrClosed)
	}
	f.closed = true
	return nil
}

func (f *memFile) Stat() (os.FileInfo, error) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("stat", false); err != nil {
		return nil, err
	}
	return info(filepath.Base(f.name), f.ino), nil
}

type fileInfo struct {
	name string
	size int64
	dir  bool
}

func info(name string, n memNode) fileInfo {
	if ino, ok := n.(*memInode); ok {
		return fileInfo{name: name, size: ino.size}
	}
	return fileInfo{name: name, dir: true}
}

func (i fileInfo) Name() string       { return i.name }
func (i fileInfo) Size() int64        { return i.size }
func (i fileInfo) ModTime() time.Time { return time.Time{} }
func (i fileInfo) IsDir() bool        { return i.dir }
func (i fileInfo) Sys() any           { return nil }

func (i fileInfo) Mode() fs.FileMode {
	if i.dir {
		return fs.ModeDir | 0o755
	}
	return 0o644
}
