package attach

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stor-io/stor/internal/durable"
)

// DefaultStateDir is where "stor-ctl nbd attach" records what it attached.
// /run is a tmpfs: the records go with a reboot, as the kernel devices do.
const DefaultStateDir = "/run/stor/nbd"

// Record is what "nbd attach" keeps about a kernel device it
// connected, in <state-dir>/<volume id>.json, so that a restarted attach
// can find the device again (and RECONFIGURE it rather than connect a new
// one), and "nbd detach" can find the process serving it.
//
// Beside it, <volume id>.lock is held (flock) by the live attach process
// for as long as it serves: the lock, not the pid, says whether a server
// is alive (the kernel drops it when the process dies, however it dies).
type Record struct {
	Volume      string `json:"volume"`
	VolumeID    string `json:"volume_id"`
	Device      string `json:"device"`
	Index       int    `json:"index"`
	Backend     string `json:"backend"`
	Connections int    `json:"connections"`
	Node        string `json:"node"`
	PID         int    `json:"pid"`
	// Epoch is the volume's epoch when this process attached it.
	Epoch uint64 `json:"epoch"`
	// Resuming is set while a resume of the device attaches the volume
	// anew (before its attach is committed and the new epoch recorded):
	// a resume that lost its attach's reply leaves the volume one epoch
	// past Epoch, attached to this node, which the next try may resume
	// (checkResumable).
	Resuming   bool      `json:"resuming,omitempty"`
	AttachedAt time.Time `json:"attached_at"`
}

// BackendID is the kernel's backend identifier for a volume: RECONFIGURE
// must name the same, so a device is never handed to another volume.
func BackendID(volumeID string) string { return "stor:" + volumeID }

// RecordPath is the file holding the record of a volume.
func RecordPath(dir, volumeID string) string { return filepath.Join(dir, volumeID+".json") }
func lockPath(dir, volumeID string) string   { return filepath.Join(dir, volumeID+".lock") }

// ValidID keeps a volume id from naming a path outside the state dir.
func ValidID(id string) error {
	if id == "" || strings.ContainsAny(id, "/\x00") || id == "." || id == ".." {
		return fmt.Errorf("volume id %q cannot name a state file", id)
	}
	return nil
}

// LoadRecord reads the record of a volume; (nil, nil) if there is none.
func LoadRecord(dir, volumeID string) (*Record, error) {
	return durable.ReadJSON[Record](RecordPath(dir, volumeID))
}

// SaveRecord writes the record atomically and durably (a temporary file,
// fsync, rename, fsync of the directory).
func SaveRecord(dir string, r *Record) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return durable.WriteFile(RecordPath(dir, r.VolumeID), append(b, '\n'))
}

// RemoveRecord removes the record of a volume, durably; no record is not an error.
func RemoveRecord(dir, volumeID string) error {
	return durable.Remove(RecordPath(dir, volumeID))
}

// Records returns every record in the state dir (unreadable ones are
// skipped with their error joined into err).
func Records(dir string) ([]*Record, error) {
	names, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	var out []*Record
	var errs []error
	for _, n := range names {
		id := strings.TrimSuffix(filepath.Base(n), ".json")
		r, err := LoadRecord(dir, id)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if r != nil {
			out = append(out, r)
		}
	}
	return out, errors.Join(errs...)
}

// ErrLocked: another live process holds a volume's lock.
var ErrLocked = errors.New("attach: locked by a live process")

// LockVolume takes the volume's lock without waiting. The returned file
// holds it until closed (or the process ends).
func LockVolume(dir, volumeID string) (*os.File, error) {
	f, err := os.OpenFile(lockPath(dir, volumeID), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, ErrLocked
		}
		return nil, fmt.Errorf("lock %s: %w", lockPath(dir, volumeID), err)
	}
	return f, nil
}

// VolumeLocked reports whether a live process holds the volume's lock.
func VolumeLocked(dir, volumeID string) (bool, error) {
	f, err := LockVolume(dir, volumeID)
	if errors.Is(err, ErrLocked) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	f.Close()
	return false, nil
}
