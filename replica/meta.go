package replica

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
)

const (
	metaName    = "meta.json"
	epochName   = "epoch"
	dirtyName   = "dirty"
	historyName = "history"
	metaFormat  = 1
)

// meta is the content of meta.json.
type meta struct {
	Format     int         `json:"format"`
	ID         string      `json:"id"`
	VolumeID   string      `json:"volumeId"`
	Size       uint64      `json:"size"`
	RegionSize int64       `json:"regionSize"`
	NextLayer  uint64      `json:"nextLayer"`
	Layers     []metaLayer `json:"layers"` // oldest first; the head last
}

// metaLayer names one layer. The head has no Snapshot; a snapshot layer
// records the volume size when it was cut.
type metaLayer struct {
	ID       uint64 `json:"id"`
	Snapshot string `json:"snapshot,omitempty"`
	Size     uint64 `json:"size,omitempty"`
}

func (m meta) clone() meta {
	m.Layers = append([]metaLayer(nil), m.Layers...)
	return m
}

func (m meta) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: meta.json: %s", ErrCorrupt, fmt.Sprintf(format, args...))
	}
	switch {
	case m.Format != metaFormat:
		return bad("format %d, want %d", m.Format, metaFormat)
	case validName(m.ID) != nil:
		return bad("replica id %q", m.ID)
	case m.VolumeID == "":
		return bad("no volume id")
	case m.Size == 0 || m.Size%BlockSize != 0 || m.Size > MaxSize:
		return bad("size %d", m.Size)
	case m.RegionSize < BlockSize || m.RegionSize%BlockSize != 0 || m.RegionSize > 1<<30:
		return bad("region size %d", m.RegionSize)
	case len(m.Layers) == 0:
		return bad("no layers")
	case m.Layers[len(m.Layers)-1].Snapshot != "":
		return bad("the last layer is snapshot %q, not the head", m.Layers[len(m.Layers)-1].Snapshot)
	}
	ids := map[uint64]bool{}
	snaps := map[string]bool{}
	for i, l := range m.Layers {
		if l.ID == 0 || l.ID >= m.NextLayer || ids[l.ID] {
			return bad("layer id %d", l.ID)
		}
		ids[l.ID] = true
		if i == len(m.Layers)-1 {
			break
		}
		if validName(l.Snapshot) != nil || snaps[l.Snapshot] {
			return bad("snapshot id %q", l.Snapshot)
		}
		if l.Size == 0 || l.Size%BlockSize != 0 || l.Size > m.Size {
			return bad("snapshot %q size %d", l.Snapshot, l.Size)
		}
		snaps[l.Snapshot] = true
	}
	return nil
}

func readMeta(fsys FS, dir string) (meta, error) {
	path := filepath.Join(dir, metaName)
	f, err := fsys.OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		if os.IsNotExist(err) {
			return meta{}, fmt.Errorf("%w: %s is missing", ErrCorrupt, path)
		}
		return meta{}, ioErr("open "+path, err)
	}
	defer f.Close()
	buf, err := readWhole(f)
	if err != nil {
		return meta{}, ioErr("read "+path, err)
	}
	var m meta
	if err := json.Unmarshal(buf, &m); err != nil {
		return meta{}, fmt.Errorf("%w: %s: %v", ErrCorrupt, path, err)
	}
	return m, m.validate()
}

// writeMeta replaces meta.json atomically: temp file, sync, rename, sync
// the directory.
func writeMeta(fsys FS, dir string, m meta) error {
	buf, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	buf = append(buf, '\n')
	tmp := filepath.Join(dir, metaName+".tmp")
	f, err := fsys.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return ioErr("create "+tmp, err)
	}
	if _, err := f.WriteAt(buf, 0); err != nil {
		f.Close()
		return ioErr("write "+tmp, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return ioErr("sync "+tmp, err)
	}
	if err := f.Close(); err != nil {
		return ioErr("close "+tmp, err)
	}
	if err := fsys.Rename(tmp, filepath.Join(dir, metaName)); err != nil {
		return ioErr("rename "+tmp, err)
	}
	return ioErr("sync dir "+dir, fsys.SyncDir(dir))
}

// The epoch file holds two 512-byte slots, each written by one sector-sized
// WriteAt and synced. A slot is:
//
//	off size
//	  0   8  magic "STOREPC1"
//	  8   8  seq (the slot written is seq % 2)
//	 16   8  epoch: the highest epoch seen
//	 24   8  generation: the highest replica-set generation seen
//	 32   4  CRC-32C of bytes 0..31
//
// The valid slot with the higher seq wins, so a write torn by a crash
// leaves the previous value (which is all that was ever acknowledged).
const (
	epochMagic    = "STOREPC1"
	epochSlotSize = SectorSize
)

type epochState struct {
	seq, epoch, gen uint64
}

func (e epochState) slot() []byte {
	b := make([]byte, epochSlotSize)
	copy(b, epochMagic)
	binary.BigEndian.PutUint64(b[8:], e.seq)
	binary.BigEndian.PutUint64(b[16:], e.epoch)
	binary.BigEndian.PutUint64(b[24:], e.gen)
	binary.BigEndian.PutUint32(b[32:], crc32.Checksum(b[:32], castagnoli))
	return b
}

func parseEpochSlot(b []byte) (epochState, bool) {
	if len(b) < 36 || string(b[:8]) != epochMagic ||
		binary.BigEndian.Uint32(b[32:]) != crc32.Checksum(b[:32], castagnoli) {
		return epochState{}, false
	}
	return epochState{
		seq:   binary.BigEndian.Uint64(b[8:]),
		epoch: binary.BigEndian.Uint64(b[16:]),
		gen:   binary.BigEndian.Uint64(b[24:]),
	}, true
}

func readEpoch(f File) (epochState, error) {
	buf := make([]byte, 2*epochSlotSize)
	if err := readFull(f, buf, 0); err != nil {
		return epochState{}, ioErr("read epoch", err)
	}
	a, aok := parseEpochSlot(buf[:epochSlotSize])
	b, bok := parseEpochSlot(buf[epochSlotSize:])
	switch {
	case aok && bok:
		if b.seq > a.seq {
			return b, nil
		}
		return a, nil
	case aok:
		return a, nil
	case bok:
		return b, nil
	}
	return epochState{}, fmt.Errorf("%w: epoch file has no valid slot", ErrCorrupt)
}

// writeEpoch durably records next (whose seq must be one more than the
// last written).
func writeEpoch(f File, next epochState) error {
	if _, err := f.WriteAt(next.slot(), int64(next.seq%2)*epochSlotSize); err != nil {
		return ioErr("write epoch", err)
	}
	return ioErr("sync epoch", f.Sync())
}

// validName accepts ids that are safe as file names everywhere: 1 to
// MaxIDLen bytes of [A-Za-z0-9._-], not starting with '.'.
func validName(s string) error {
	if s == "" || len(s) > MaxIDLen || s[0] == '.' {
		return fmt.Errorf("%w: id %q: want 1..%d characters of [A-Za-z0-9._-], not starting with '.'", ErrInvalid, s, MaxIDLen)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%w: id %q: character %q not allowed", ErrInvalid, s, c)
		}
	}
	return nil
}
