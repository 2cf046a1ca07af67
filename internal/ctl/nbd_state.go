package ctl

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// defaultNBDStateDir is where "nbd attach" records what it attached.
// /run is a tmpfs: the records go with a reboot, as the kernel devices do.
const defaultNBDStateDir = "/run/stor/nbd"

// attachRecord is what "nbd attach" keeps about a kernel device it
// connected, in <state-dir>/<volume id>.json, so that a restarted attach
// can find the device again (and RECONFIGURE it rather than connect a new
// one), and "nbd detach" can find the process serving it.
//
// Beside it, <volume id>.lock is held (flock) by the live attach process
// for as long as it serves: the lock, not the pid, says whether a server
// is alive (the kernel drops it when the process dies, however it dies).
type attachRecord struct {
	Volume      string `json:"volume"`
	VolumeID    string `json:"volume_id"`
	Device      string `json:"device"`
	Index       int    `json:"index"`
	Backend     string `json:"backend"`
	Connections int    `json:"connections"`
	Node        string `json:"node"`
	PID         int    `json:"pid"`
	// Epoch is the volume's epoch when this process attached it.
	Epoch      uint64    `json:"epoch"`
	AttachedAt time.Time `json:"attached_at"`
}

// backendID is the kernel's backend identifier for a volume: RECONFIGURE
// must name the same, so a device is never handed to another volume.
func backendID(volumeID string) string { return "stor:" + volumeID }

func recordPath(dir, volumeID string) string { return filepath.Join(dir, volumeID+".json") }
func lockPath(dir, volumeID string) string   { return filepath.Join(dir, volumeID+".lock") }

// validID keeps a volume id from naming a path outside the state dir.
func validID(id string) error {
	if id == "" || strings.ContainsAny(id, "/\x00") || id == "." || id == ".." {
		return fmt.Errorf("volume id %q cannot name a state file", id)
	}
	return nil
}

// loadRecord reads the record of a volume; (nil, nil) if there is none.
func loadRecord(dir, volumeID string) (*attachRecord, error) {
	b, err := os.ReadFile(recordPath(dir, volumeID))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var r attachRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("state file %s: %w", recordPath(dir, volumeID), err)
	}
	return &r, nil
}

// saveRecord writes the record atomically and durably (a temporary file,
// fsync, rename, fsync of the directory).
func saveRecord(dir string, r *attachRecord) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, ".record-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), recordPath(dir, r.VolumeID)); err != nil {
		return err
	}
	return syncDir(dir)
}

func removeRecord(dir, volumeID string) error {
	err := os.Remove(recordPath(dir, volumeID))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// records returns every record in the state dir (unreadable ones are
// skipped with their error joined into err).
func records(dir string) ([]*attachRecord, error) {
	names, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	var out []*attachRecord
	var errs []error
	for _, n := range names {
		id := strings.TrimSuffix(filepath.Base(n), ".json")
		r, err := loadRecord(dir, id)
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

// errLocked: another live process holds a volume's lock.
var errLocked = errors.New("locked by a live process")

// lockVolume takes the volume's lock without waiting. The returned file
// holds it until closed (or the process ends).
func lockVolume(dir, volumeID string) (*os.File, error) {
	f, err := os.OpenFile(lockPath(dir, volumeID), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, errLocked
		}
		return nil, fmt.Errorf("lock %s: %w", lockPath(dir, volumeID), err)
	}
	return f, nil
}

// volumeLocked reports whether a live process holds the volume's lock.
func volumeLocked(dir, volumeID string) (bool, error) {
	f, err := lockVolume(dir, volumeID)
	if errors.Is(err, errLocked) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	f.Close()
	return false, nil
}
