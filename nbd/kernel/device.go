package kernel

import (
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ParseDevice accepts a device as "/dev/nbd3", "nbd3" or "3" and returns
// its index.
func ParseDevice(s string) (int, error) {
	t := strings.TrimPrefix(s, "/dev/")
	t = strings.TrimPrefix(t, "nbd")
	n, err := strconv.Atoi(t)
	if err != nil || n < 0 || t != strconv.Itoa(n) {
		return 0, fmt.Errorf("%w: %q is not an nbd device (want /dev/nbdN, nbdN or N)", ErrInvalid, s)
	}
	return n, nil
}

// sysBlock is where the kernel shows block devices; tests point it
// elsewhere.
var sysBlock = "/sys/block"

func readSys(index int, name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(sysBlock, fmt.Sprintf("nbd%d", index), name))
	if err != nil {
		return "", err
	}
	return strings.TrimRight(string(b), "\n"), nil
}

// Backend returns the backend identifier of a connected device
// (/sys/block/nbdN/backend), "" when it has none or is not connected.
func Backend(index int) (string, error) {
	s, err := readSys(index, "backend")
	if errors.Is(err, os.ErrNotExist) {
		if _, serr := os.Stat(filepath.Join(sysBlock, fmt.Sprintf("nbd%d", index))); serr != nil {
			return "", fmt.Errorf("%w: %s", ErrNoDevice, Path(index))
		}
		return "", nil // the attribute exists only while connected
	}
	return s, err
}

// SizeBytes returns the size the kernel gives the device now (0 when not
// connected).
func SizeBytes(index int) (uint64, error) {
	s, err := readSys(index, "size")
	if errors.Is(err, os.ErrNotExist) {
		return 0, fmt.Errorf("%w: %s", ErrNoDevice, Path(index))
	}
	if err != nil {
		return 0, err
	}
	sectors, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("kernel: %s size %q: %w", Path(index), s, err)
	}
	return sectors * 512, nil
}

// QueueTimeout returns the timer of the device's block queue
// (/sys/block/nbdN/queue/io_timeout): how long a request runs before the
// kernel's nbd driver looks at it (SetQueueTimeout).
func QueueTimeout(index int) (time.Duration, error) {
	s, err := readSys(index, "queue/io_timeout")
	if errors.Is(err, os.ErrNotExist) {
		return 0, fmt.Errorf("%w: %s", ErrNoDevice, Path(index))
	}
	if err != nil {
		return 0, err
	}
	ms, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("kernel: %s io_timeout %q: %w", Path(index), s, err)
	}
	return time.Duration(ms) * time.Millisecond, nil
}

// SetQueueTimeout sets the timer of the device's block queue
// (/sys/block/nbdN/queue/io_timeout, in milliseconds; at least 1 ms):
// each request that runs that long is handed to the nbd driver's timeout
// handler, and again every d while the handler keeps it. With the
// kernel's request timeout off (NoTimeout) and one connection, the
// handler keeps a request whose connection is the live one and resends
// one whose connection was replaced, so d bounds how long requests that
// were in flight on a dead connection wait once a Reconfigure has given a
// new one (the package documentation, "Requeue without a request
// timeout"). It applies to requests started from then on; Connect and a
// Reconfigure that sets a timeout reset it. Linux from 6.11 (until a
// later release dropped it again) freezes the queue for the write: it
// waits until every request in the device has ended, so never write it
// while requests are in flight on a dead connection (they end only once
// a Reconfigure replaced it and their timer resent them). Needs root
// (sysfs).
func SetQueueTimeout(index int, d time.Duration) error {
	if d < time.Millisecond || d/time.Millisecond > math.MaxUint32 {
		return fmt.Errorf("%w: queue timeout %v (want 1ms to %dms)", ErrInvalid, d, uint32(math.MaxUint32))
	}
	p := filepath.Join(sysBlock, fmt.Sprintf("nbd%d", index), "queue", "io_timeout")
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_TRUNC, 0) // as the shell's >
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%w: %s", ErrNoDevice, Path(index))
	}
	if err != nil {
		return fmt.Errorf("kernel: %s queue timeout: %w", Path(index), err)
	}
	_, err = f.WriteString(strconv.FormatInt(int64(d/time.Millisecond), 10))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("kernel: %s queue timeout: %w", Path(index), err)
	}
	return nil
}

// ErrBusy: the device is open exclusively elsewhere (mounted, or held by
// a device mapper or another exclusive opener).
var ErrBusy = errors.New("kernel: device is in use (mounted or held open exclusively)")

// OpenExclusive opens the device node exclusively (O_EXCL), which the
// kernel refuses with EBUSY while the device is mounted or held by another
// exclusive opener: ErrBusy. Holding the returned file keeps others from
// mounting it. Opening may read the device (a partition scan).
func OpenExclusive(index int) (*os.File, error) {
	f, err := os.OpenFile(Path(index), os.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EBUSY) {
		return nil, fmt.Errorf("%s: %w", Path(index), ErrBusy)
	}
	return f, err
}

// SocketPair returns a connected pair of unix stream sockets: one end as a
// file to hand the kernel (Options.Sockets, Reconfig.Sockets), the other
// as a net.Conn to serve (nbd.Server.ServeTransmission). The caller closes
// the file once the kernel has it, and the conn when done.
func SocketPair() (kernelEnd *os.File, serverEnd net.Conn, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("kernel: socketpair: %w", err)
	}
	kernelEnd = os.NewFile(uintptr(fds[0]), "nbd-kernel")
	sf := os.NewFile(uintptr(fds[1]), "nbd-server")
	serverEnd, err = net.FileConn(sf) // dups the descriptor
	sf.Close()
	if err != nil {
		kernelEnd.Close()
		return nil, nil, fmt.Errorf("kernel: socketpair: %w", err)
	}
	return kernelEnd, serverEnd, nil
}
