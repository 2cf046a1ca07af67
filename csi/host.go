package csi

import (
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
	mount "k8s.io/mount-utils"
	"k8s.io/utils/exec"
)

// Host is what the node service does to the host besides attaching:
// mounts, filesystems, device sizes. NewHost is the real one; tests use
// mount-utils' FakeMounter.
type Host struct {
	// Mounter mounts, unmounts and checks mount points.
	Mounter mount.Interface
	// FormatAndMount formats source with fstype if it holds no
	// filesystem, then mounts it (mount-utils SafeFormatAndMount).
	FormatAndMount func(source, target, fstype string, options []string) error
	// ResizeFS grows the filesystem on device mounted at mountPath to the
	// device's size (mount-utils ResizeFs: resize2fs, xfs_growfs).
	ResizeFS func(device, mountPath string) error
	// DeviceSize is a block device's size in bytes.
	DeviceSize func(device string) (int64, error)
}

// NewHost is the real host: mount(8), mkfs, resize2fs/xfs_growfs, and
// the BLKGETSIZE64 ioctl.
func NewHost() *Host {
	m := mount.New("")
	sfm := &mount.SafeFormatAndMount{Interface: m, Exec: exec.New()}
	rs := mount.NewResizeFs(exec.New())
	return &Host{
		Mounter:        m,
		FormatAndMount: sfm.FormatAndMount,
		ResizeFS: func(device, path string) error {
			_, err := rs.Resize(device, path)
			return err
		},
		DeviceSize: blockDeviceSize,
	}
}

func blockDeviceSize(device string) (int64, error) {
	f, err := os.Open(device)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var size uint64
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&size))); errno != 0 {
		return 0, fmt.Errorf("BLKGETSIZE64 %s: %w", device, errno)
	}
	return int64(size), nil
}
