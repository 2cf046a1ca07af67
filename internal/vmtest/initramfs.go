package vmtest

import (
	"bufio"
	"bytes"
	"debug/elf"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// image is an initramfs being assembled: guest path -> entry.
type image struct {
	entries map[string]entry
}

type entry struct {
	mode fs.FileMode // type and permission bits
	data []byte      // file contents, or a symlink's target
	host string      // a host file to copy instead of data
}

func newImage() *image {
	return &image{entries: map[string]entry{}}
}

func (im *image) dir(p string) {
	p = path.Clean("/" + p)
	for p != "/" {
		if _, ok := im.entries[p]; ok {
			return
		}
		im.entries[p] = entry{mode: fs.ModeDir | 0o755}
		p = path.Dir(p)
	}
}

func (im *image) add(p string, e entry) {
	p = path.Clean("/" + p)
	im.dir(path.Dir(p))
	im.entries[p] = e
}

// addFile adds a host file (symlinks followed) at guest path p.
func (im *image) addFile(p, host string, mode fs.FileMode) error {
	fi, err := os.Stat(host)
	if err != nil {
		return fmt.Errorf("vmtest: %w", err)
	}
	if mode == 0 {
		mode = fi.Mode().Perm()
	}
	im.add(p, entry{mode: mode.Perm(), host: host})
	return nil
}

func (im *image) addBytes(p string, data []byte, mode fs.FileMode) {
	im.add(p, entry{mode: mode.Perm(), data: data})
}

func (im *image) addSymlink(p, target string) {
	im.add(p, entry{mode: fs.ModeSymlink | 0o777, data: []byte(target)})
}

// lddLine matches "libx.so.1 => /path (0x...)" and "/lib64/ld-linux... (0x...)".
var lddLine = regexp.MustCompile(`(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)`)

// addProgram adds a host program at the same path in the guest, with the
// shared libraries ldd lists for it (none for a static one).
func (im *image) addProgram(host string) error {
	if !filepath.IsAbs(host) {
		p, err := exec.LookPath(host)
		if err != nil {
			return fmt.Errorf("vmtest: program %s: %w", host, err)
		}
		host = p
	}
	if err := im.addFile(host, host, 0o755); err != nil {
		return err
	}
	out, err := exec.Command("ldd", host).CombinedOutput()
	if err != nil {
		if bytes.Contains(out, []byte("not a dynamic executable")) || bytes.Contains(out, []byte("statically linked")) {
			return nil
		}
		return fmt.Errorf("vmtest: ldd %s: %v: %s", host, err, out)
	}
	for _, m := range lddLine.FindAllStringSubmatch(string(out), -1) {
		if err := im.addFile(m[1], m[1], 0o755); err != nil {
			return err
		}
	}
	return nil
}

// modules resolves kernel modules by name in a module tree.
type modules struct {
	dir   string
	paths map[string]string // normalised name -> path
}

func normModName(n string) string { return strings.ReplaceAll(n, "-", "_") }

func loadModules(dir string) (*modules, error) {
	m := &modules{dir: dir, paths: map[string]string{}}
	err := filepath.WalkDir(filepath.Join(dir, "kernel"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if n, ok := strings.CutSuffix(d.Name(), ".ko"); ok && !d.IsDir() {
			m.paths[normModName(n)] = p
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("vmtest: module tree %s: %w", dir, err)
	}
	return m, nil
}

// modinfo reads a module's .modinfo section: key=value strings.
func modinfo(p string) (map[string][]string, error) {
	f, err := elf.Open(p)
	if err != nil {
		return nil, fmt.Errorf("vmtest: module %s: %w", p, err)
	}
	defer f.Close()
	s := f.Section(".modinfo")
	if s == nil {
		return nil, fmt.Errorf("vmtest: module %s has no .modinfo", p)
	}
	b, err := s.Data()
	if err != nil {
		return nil, err
	}
	info := map[string][]string{}
	for _, kv := range bytes.Split(b, []byte{0}) {
		if k, v, ok := strings.Cut(string(kv), "="); ok {
			info[k] = append(info[k], v)
		}
	}
	return info, nil
}

// resolve returns the modules to load, dependencies before dependents,
// each once.
func (m *modules) resolve(names []string) ([]string, error) {
	var order []string
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(n string) error
	visit = func(n string) error {
		n = normModName(n)
		switch state[n] {
		case 1:
			return fmt.Errorf("vmtest: module dependency cycle at %s", n)
		case 2:
			return nil
		}
		p, ok := m.paths[n]
		if !ok {
			return fmt.Errorf("vmtest: no module %s.ko under %s (built in? then leave it out)", n, m.dir)
		}
		state[n] = 1
		info, err := modinfo(p)
		if err != nil {
			return err
		}
		for _, deps := range info["depends"] {
			for d := range strings.SplitSeq(deps, ",") {
				if d = strings.TrimSpace(d); d != "" {
					if err := visit(d); err != nil {
						return err
					}
				}
			}
		}
		state[n] = 2
		order = append(order, n)
		return nil
	}
	for _, n := range names {
		if err := visit(n); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// writeCpio writes the image as an uncompressed newc cpio archive (the
// kernel unpacks it as the initramfs).
func (im *image) writeCpio(w io.Writer) error {
	bw := bufio.NewWriterSize(w, 1<<20)
	paths := make([]string, 0, len(im.entries))
	for p := range im.entries {
		paths = append(paths, p)
	}
	sort.Strings(paths) // parents before children
	ino := 1
	for _, p := range paths {
		e := im.entries[p]
		data := e.data
		if e.host != "" {
			b, err := os.ReadFile(e.host)
			if err != nil {
				return fmt.Errorf("vmtest: %w", err)
			}
			data = b
		}
		mode := uint32(e.mode.Perm())
		switch {
		case e.mode.IsDir():
			mode |= 0o040000
			data = nil
		case e.mode&fs.ModeSymlink != 0:
			mode |= 0o120000
		default:
			mode |= 0o100000
		}
		if err := cpioEntry(bw, ino, strings.TrimPrefix(p, "/"), mode, data); err != nil {
			return err
		}
		ino++
	}
	if err := cpioEntry(bw, ino, "TRAILER!!!", 0, nil); err != nil {
		return err
	}
	return bw.Flush()
}

func cpioEntry(w *bufio.Writer, ino int, name string, mode uint32, data []byte) error {
	nlink := 1
	if mode&0o170000 == 0o040000 {
		nlink = 2
	}
	// magic, ino, mode, uid, gid, nlink, mtime, filesize, devmajor,
	// devminor, rdevmajor, rdevminor, namesize, check.
	fmt.Fprintf(w, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
	w.WriteString(name)
	w.WriteByte(0)
	pad(w, 110+len(name)+1)
	w.Write(data)
	pad(w, len(data))
	return nil
}

func pad(w *bufio.Writer, n int) {
	for ; n%4 != 0; n++ {
		w.WriteByte(0)
	}
}
