package ep

// DeviceRoute makes w, a new world, move rows as a world on one GPU does: each rank
// copies what it receives on its own stream, in the order of the ranks' events. On the
// CPU that runs the protocol of the device route (but staging, which is for ranks on
// other GPUs) with host memory.
func DeviceRoute(w *World) (*World, error) {
	dr, err := newDevRanks(w.devs)
	if err != nil {
		return nil, err
	}
	w.route, w.dr = viaDevice, dr
	return w, nil
}
