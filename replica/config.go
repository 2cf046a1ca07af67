package replica

import (
	"fmt"
	"log/slog"
)

const (
	// DefaultRegionSize is the granularity of the dirty-region log and of
	// the write history of a new replica.
	DefaultRegionSize = 1 << 20
	// MaxSize is the largest volume a replica holds (1 PiB).
	MaxSize = 1 << 50
	// MaxIDLen bounds replica and snapshot ids.
	MaxIDLen = 128
)

// defaultMaxOpenFiles is half the open-file limit, from 64 to 4096: the
// rest is the process's (connections, Raft, its database).
func defaultMaxOpenFiles() int {
	return min(max(openFileLimit()/2, 64), 4096)
}

// Config configures a Store. Zero fields take the defaults noted.
type Config struct {
	// Dir holds one directory per replica. Required; created if missing.
	Dir string
	// FS is the filesystem the store uses. Default OS().
	FS FS
	// Logger receives damaged-replica reports, recovery notes and I/O
	// failures. Default slog.Default().
	Logger *slog.Logger
	// RegionSize is the dirty-region and write-history granularity of
	// replicas created from now on (an existing replica keeps the size it
	// was created with). A multiple of BlockSize, at most 1 GiB. Default
	// DefaultRegionSize (1 MiB).
	RegionSize int64
	// MaxOpenFiles bounds the files the store keeps open for its replicas
	// (an open replica holds 3, plus 2 per layer): when opening one would
	// pass it, the least recently used idle replicas are synced and their
	// files closed; they reopen on their next request (doc.go, "Open
	// files"). At least 5. Default: half the process's open-file limit
	// (RLIMIT_NOFILE), from 64 to 4096.
	MaxOpenFiles int
}

// DefaultConfig returns a Config with every default filled in except Dir.
func DefaultConfig() Config {
	return Config{FS: OS(), Logger: slog.Default(), RegionSize: DefaultRegionSize, MaxOpenFiles: defaultMaxOpenFiles()}
}

// Validate checks the config after defaults are applied to zero fields.
func (c Config) Validate() error {
	c = c.withDefaults()
	switch {
	case c.Dir == "":
		return fmt.Errorf("%w: config: Dir is required", ErrInvalid)
	case c.MaxOpenFiles < 5:
		return fmt.Errorf("%w: config: MaxOpenFiles %d is below 5", ErrInvalid, c.MaxOpenFiles)
	case c.RegionSize < BlockSize || c.RegionSize%BlockSize != 0 || c.RegionSize > 1<<30:
		return fmt.Errorf("%w: config: RegionSize %d is not a multiple of %d in [%d, 1 GiB]",
			ErrInvalid, c.RegionSize, BlockSize, BlockSize)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.FS == nil {
		c.FS = OS()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.RegionSize == 0 {
		c.RegionSize = DefaultRegionSize
	}
	if c.MaxOpenFiles == 0 {
		c.MaxOpenFiles = defaultMaxOpenFiles()
	}
	return c
}
